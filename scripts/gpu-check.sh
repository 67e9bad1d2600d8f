#!/usr/bin/env bash
# gpu-check.sh: Ingero's NCCL profiler plugin on a real NVIDIA GPU, without eBPF.
#
# For a machine with one NVIDIA GPU (or more), gcc and PyTorch (with its
# NCCL), and no bcc, apt or network. It
#   1. builds the plugin (agent/nccl_profiler) with its file sink; without
#      <sys/sdt.h> it leaves the USDT probe out (-DINGERO_PROFILER_NO_USDT);
#   2. runs scripts/gpu_check.py in one process with NCCL_PROFILER_PLUGIN and
#      INGERO_PROFILER_FILE set: torch.distributed on NCCL (world size 1:
#      all-reduce, all-gather, a coalesced launch, batch_isend_irecv to
#      itself), then two 2-rank NCCL communicators (two "process groups",
#      ncclCommInitAll, a CUDA stream per rank) launching an all-reduce, a
#      coalesced reduce-scatter + all-gather and a grouped send/recv
#      exchange, each bracketed by CUDA events on every rank's stream;
#   3. compares each launch's device interval from the plugin with the CUDA
#      events, checks that the operations of a launch share one group number,
#      that the stream the plugin reports is the stream the call was made on,
#      and that the plugin's GPU-to-host clock fit puts the launch where the
#      events and the host clock say it ran; prints a short table.
# Exit 0: every check held; 1: a mismatch (the table says which); 2: nothing
# could be checked (no GPU, no torch, an NCCL that loads no v4-v6 profiler,
# one GPU with NCCL before 2.30).
#
# NCCL profiles no 1-rank communicator's work (a collective is a local copy,
# enqueue.cc ncclLaunchOneRank; a send to self has no proxy operation, so no
# kernel-channel events): torch's world-size-1 calls are only counted, and
# the timed communicators have 2 ranks, on two GPUs or, from NCCL 2.30, both
# on one (NCCL_MULTI_RANK_GPU_ENABLE=1, set below; with torch's own NCCL older
# than that, LD_PRELOAD a libnccl.so.2 of 2.30 or later).
#
# NOT YET RUN ON A GPU: checked for syntax, and its judging on fabricated
# records, only.
#
# Usage: scripts/gpu-check.sh [WORK_DIR]     (PYTHON=... picks the interpreter)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${1:-$(mktemp -d -t ingero-gpu-check.XXXXXX)}
PY=${PYTHON:-python3}
mkdir -p "$WORK"

if ! command -v gcc >/dev/null; then
    echo "gpu-check: gcc is not installed: it builds the plugin" >&2
    exit 2
fi
FLAGS=(-O2 -g -fPIC -pthread -Wall -Wextra -fvisibility=hidden -shared
       "-I$ROOT/bpf" "-I$ROOT/ingero/csrc")
if ! echo '#include <sys/sdt.h>' | gcc -E -x c - >/dev/null 2>&1; then
    echo "gpu-check: no <sys/sdt.h>: building the plugin without its USDT probe (the file sink is enough here)"
    FLAGS+=(-DINGERO_PROFILER_NO_USDT)
fi
LIB="$WORK/libnccl-profiler-ingero.so"
gcc "${FLAGS[@]}" -o "$LIB" "$ROOT/agent/nccl_profiler/ingero_profiler.c" -lm

rm -f "$WORK/ops.txt"
export NCCL_PROFILER_PLUGIN="$LIB"
export INGERO_PROFILER_FILE="$WORK/ops.txt"
export INGERO_PROFILER_CLOCK_WINDOW_MS=100      # a fitted drift within the first second
export NCCL_MULTI_RANK_GPU_ENABLE=1             # NCCL 2.30+: two ranks of a communicator on one GPU
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
echo "gpu-check: plugin $LIB, records in $INGERO_PROFILER_FILE"
rc=0
timeout 280 "$PY" "$ROOT/scripts/gpu_check.py" "$WORK" || rc=$?
if [ "$rc" = 124 ]; then
    echo "gpu-check: the job ran past 280 s" >&2
    exit 1
fi
exit "$rc"
