#!/usr/bin/env bash
# A docker daemon for `make images` and tests/images. Does nothing when `docker info`
# answers. Otherwise, as root, starts Debian's dockerd (docker.io, installed by `make
# setup`): systemd's unit where systemd runs, else dockerd in the background, leaving the
# host's firewall and bridges alone (--iptables=false --bridge=none): the builds and the
# containers use the host's network (--network host), as the agent's DaemonSet does.
# Its log: /var/log/ingero-dockerd.log.
set -euo pipefail
docker info >/dev/null 2>&1 && exit 0
if [[ $(id -u) -ne 0 ]]; then
  echo "docker-daemon: no docker daemon answers and starting one needs root; start docker or run as root" >&2
  exit 1
fi
if ! command -v dockerd >/dev/null; then
  echo "docker-daemon: dockerd is not installed; run 'make setup' (Debian's docker.io)" >&2
  exit 1
fi
log=/var/log/ingero-dockerd.log
if [[ -d /run/systemd/system ]]; then
  systemctl start docker
else
  setsid dockerd --iptables=false --ip6tables=false --bridge=none >>"$log" 2>&1 </dev/null &
fi
for _ in $(seq 120); do
  docker info >/dev/null 2>&1 && exit 0
  sleep 0.5
done
echo "docker-daemon: dockerd did not answer within 60 s; see $log" >&2
exit 1
