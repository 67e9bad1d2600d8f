"""`ingero lab`: a real multi-node training workload on one machine.

Network namespaces are the nodes, pod-like cgroup v2 directories the pods, and
a CPU implementation of the NCCL API (``csrc/``) moves the data over real TCP,
so faults (packet loss, CPU contention, slow compute, I/O stalls) produce the
same signals a GPU cluster would: retransmits, run-queue waits, late arrivals.
"""
