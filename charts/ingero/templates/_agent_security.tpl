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
  # with CAP_PERFMON in its default profile.
  type: RuntimeDefault
capabilities:
  drop: [ALL]
  add:
    # bpf(2): load the tracing programs, create the maps and ring buffers (kernel >= 5.8).
    - BPF
    # perf_event_open(2) for tracepoints and uprobes, and BPF helpers that
    # read kernel and user memory (bpf_probe_read_*).
    - PERFMON
    # Raise RLIMIT_MEMLOCK for BPF maps on kernels before 5.11 (no memcg accounting).
    - SYS_RESOURCE
    # /proc/<pid>/environ, /maps and /root of processes of other users, or not
    # dumpable (ptrace access mode read).
    - SYS_PTRACE
    # Read those /proc files (mode 0400, owned by the training user) and the NCCL
    # library through /proc/<pid>/root whatever its folder's permissions.
    - DAC_READ_SEARCH
    {{- range .Values.agent.extraCapabilities }}
    # Added by agent.extraCapabilities.
    - {{ . }}
    {{- end }}
{{- end }}
{{- end -}}
