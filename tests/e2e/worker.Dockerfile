# The e2e training job's image: the lab's CPU implementation of the NCCL API
# (libnccl.so.2) and its data-parallel worker, built by the lab's own build code
# (ingero/lab/build.py, which includes the NCCL profiler ABI header from
# ingero/csrc/), in /opt/lab. The job's pods run tests/e2e/workload.py's
# RANK_SCRIPT with /bin/sh. Build from the repository root:
#   docker build -f tests/e2e/worker.Dockerfile -t ingero-lab-worker:e2e .
FROM debian:bookworm-slim AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev python3 \
 && rm -rf /var/lib/apt/lists/*
COPY ingero/ /src/ingero/
RUN cd /src && INGERO_CACHE=/cache python3 -c "from ingero.lab.build import build_lab_binaries as b; print(b().dir)" \
 && mkdir -p /opt/lab && cp /cache/lab/*/libnccl.so.2 /cache/lab/*/ingero-lab-worker /opt/lab/

FROM debian:bookworm-slim
COPY --from=build /opt/lab /opt/lab
# The worker finds the library beside it ($ORIGIN rpath).
RUN ldd /opt/lab/ingero-lab-worker | grep -q "libnccl.so.2 => /opt/lab/libnccl.so.2"
# The ranks run as another user than the agent: what SYS_PTRACE is for (their /proc/<pid>/maps,
# root and environ; the environment is read from process memory, no DAC_READ_SEARCH).
USER 65532:65532
