#!/usr/bin/env bash
# Installs the Debian packages Ingero needs and arranges what the agent needs
# from the host: kernel headers under /lib/modules/$(uname -r) and a mounted
# tracefs. Idempotent: does nothing that is already done.
set -euo pipefail
missing=()
for p in "$@"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "setup: missing Debian packages: ${missing[*]}; run 'make setup' as root or install them" >&2
    exit 1
  fi
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if [[ $(id -u) -eq 0 ]]; then
  # Headers: the agent can do this itself (ingero_agent.headers), but doing it
  # once here keeps test output quiet.
  /usr/bin/python3 -c 'import sys; sys.path.insert(0, "agent"); from ingero_agent.headers import ensure_kernel_build_dir as e; print("setup: kernel headers:", e())' || true
  mountpoint -q /sys/kernel/tracing || mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null || true
  mountpoint -q /sys/kernel/debug || mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null || true
fi
