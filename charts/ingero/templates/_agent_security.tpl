{{/* The agent container's security context, shared with its preflight. */}}
{{- define "ingero.agent.securityContext" -}}
# root: tracefs (mode 0700) and the data folder are root's; every privilege
# beyond file ownership comes from the capabilities below, not from uid 0.
runAsUser: 0
readOnlyRootFilesystem: true
{{- if .Values.agent.privileged }}
# Fallback (agent.privileged): every capability, no seccomp or LSM confinement.
privileged: true
{{- else }}
allowPrivilegeEscalation: false
seccompProfile:
  # containerd >= 1.7 allows bpf(2) with CAP_BPF and perf_event_open(2)
  # with CAP_PERFMON in its default profile, process_vm_readv(2) with CAP_SYS_PTRACE.
  type: RuntimeDefault
capabilities:
  drop: [ALL]
  # Exactly what the agent needs, each proven by tests/bpf/test_capabilities.py (which
  # also checks this list): without any one, tracing fails as its comment says.
  # Kernels before 5.11 also need SYS_RESOURCE (RLIMIT_MEMLOCK for BPF maps):
  # agent.extraCapabilities: [SYS_RESOURCE]. No DAC_READ_SEARCH: another user's
  # /proc/<pid>/environ (0400) is read from process memory (process_vm_readv) instead. No SYS_ADMIN:
  # from 6.16 the NCCL uprobes are made in tracefs (mounted writable), not the perf uprobe PMU.
  add:
    # bpf(2): create the maps and ring buffers and load the programs (without it: map creation EPERM).
    - BPF
    # Load tracing programs (tracepoint, uprobe) and perf_event_open them (without it: program load EPERM).
    - PERFMON
    # /proc/<pid>/maps, root, environ of other users' processes (else their NCCL library and rank are unseen);
    # it also permits PTRACE_ATTACH to any host process (hostPID) unless Yama ptrace_scope is 3 (which
    # also blocks the environment read); the agent only reads.
    - SYS_PTRACE
    {{- range .Values.agent.extraCapabilities }}
    # Added by agent.extraCapabilities.
    - {{ . }}
    {{- end }}
{{- end }}
{{- end -}}
