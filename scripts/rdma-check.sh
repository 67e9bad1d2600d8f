#!/usr/bin/env bash
# rdma-check.sh: what Ingero's agent reads from this node's RDMA NICs, without eBPF.
#
# For a node with InfiniBand or RoCE devices (/sys/class/infiniband) and
# python3; run from a checkout of this repository (no install, no bcc). It
#   1. lists every port as the agent records it in rdma_ports (state, rate,
#      link layer, counters stuck at their maximum);
#   2. reads every port's counters/ and hw_counters/ twice, SECONDS apart
#      (default 5), and prints each counter that rose, as rdma_counters rows
#      (bytes for port_xmit_data and port_rcv_data);
#   3. for every process that holds an RDMA device open or has NCCL_IB_HCA in
#      its environment (root reads every process's), prints the ports the
#      agent maps it to and how (rdma_ranks).
# Run it while a job trains to see its traffic, and with `perfquery` or
# `rdma statistic` beside it to compare the figures.
# Exit 0: ports were read; 2: no RDMA device here.
#
#   scripts/rdma-check.sh [SECONDS] [SYSFS_ROOT]
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_APART="${1:-5}"
SYSFS="${2:-/sys}"
exec env PYTHONPATH="$PWD/agent:$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 - "$SECONDS_APART" "$SYSFS" <<'EOF'
import os
import sys
import time
from pathlib import Path

from ingero_agent.procinfo import read_environ
from ingero_agent.rdma import RdmaSampler

apart, sysfs = float(sys.argv[1]), Path(sys.argv[2])
s = RdmaSampler(sysfs)
s.sample()
if not s.ports:
    print(f"no RDMA port under {sysfs}/class/infiniband")
    sys.exit(2)
print("ports (rdma_ports):")
for p in s.port_rows():
    print(f"  {p['device']} port {p['port']}: {p['state']}, {p['phys_state']}, {p['rate']}, "
          f"{p['link_layer']}" + (f"; saturated: {p['saturated']}" if p["saturated"] else ""))
time.sleep(apart)
rows = s.sample()
print(f"rises over {apart:g} s (rdma_counters), read in {1e3 * s.read_s / s.reads:.1f} ms per pass:")
for dev, port, name, delta, interval in sorted(rows):
    print(f"  {dev} port {port} {name}: {delta:,} in {interval / 1e9:.2f} s")
if not rows:
    print("  none")
procs = []
for pid in sorted(int(d) for d in os.listdir("/proc") if d.isdigit()):
    env = read_environ(pid)
    procs.append((pid, int(env["RANK"]) if env.get("RANK", "").isdigit() else None, env))
found = s.rank_rows(procs, Path("/proc"))
print("processes and their ports (rdma_ranks):")
for r in found:
    print(f"  pid {r['pid']} (RANK {r['rank']}): {r['device']} port {r['port']} by {r['source']}")
if not found:
    print("  none (no process holds an RDMA device open or sets NCCL_IB_HCA)")
EOF
