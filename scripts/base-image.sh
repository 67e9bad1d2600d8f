#!/usr/bin/env bash
# The base image of Dockerfile.agent and Dockerfile.operator, made here from the Debian
# mirror with mmdebstrap (no image registry is asked): Debian bookworm, minbase, slimmed as
# debian:bookworm-slim is (no manuals, docs or locales; merged /usr without the usrmerge
# package, which would pull perl in; dpkg without an fsync per file, apt without the
# translated descriptions, as in Docker Hub's Debian images), with ca-certificates and this
# machine's extra CA certificates (/usr/local/share/ca-certificates, e.g. a TLS-intercepting
# proxy's), so that pip inside the builds trusts what this machine trusts.
# Prints the image's name, ingero-base:bookworm-<key>; the key hashes the recipe below, the
# mirror and the certificates. The root filesystem is kept as a tarball under
# $INGERO_CACHE/images (default ~/.cache/ingero/images): a machine that keeps that folder
# imports it again in seconds instead of bootstrapping (~15 s with a fast mirror, minutes
# with a slow one).
#   DEBIAN_MIRROR  the mirror (default http://deb.debian.org/debian; security updates from
#                  its -security sibling)
set -euo pipefail
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
recipe=(--variant=minbase --include=ca-certificates --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr
        --aptopt='APT::Install-Recommends "false"' --aptopt='Acquire::Languages "none"' --dpkgopt=force-unsafe-io
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
        --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias')
certs=()
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  certs=(/usr/local/share/ca-certificates/*.crt)
fi
key=$( { echo "${recipe[*]}"; echo "$mirror"; cat "${certs[@]}" </dev/null; } | sha256sum | cut -c1-12)
image=ingero-base:bookworm-$key
if docker image inspect "$image" >/dev/null 2>&1; then
  echo "$image"
  exit 0
fi
cache=${INGERO_CACHE:-$HOME/.cache/ingero}/images
tarball=$cache/base-bookworm-$key.tar
if [[ ! -s $tarball ]]; then
  command -v mmdebstrap >/dev/null || { echo "base-image: mmdebstrap is not installed; run 'make setup'" >&2; exit 1; }
  mkdir -p "$cache"
  hooks=()
  if ((${#certs[@]})); then
    hooks=(--customize-hook="copy-in ${certs[*]} /usr/local/share/ca-certificates/"
           --customize-hook='chroot "$1" update-ca-certificates')
  fi
  echo "base-image: bootstrapping Debian bookworm from $mirror" >&2
  # Debian's python3 for mmdebstrap's helpers (mmtarfilter, once per package), not one that comes
  # first on PATH (a pyenv shim costs a shell per call)
  PATH=/usr/sbin:/usr/bin:/sbin:/bin mmdebstrap --quiet "${recipe[@]}" "${hooks[@]}" --format=tar bookworm \
    "$tarball.part" \
    "deb $mirror bookworm main" "deb $mirror bookworm-updates main" "deb ${mirror%/}-security bookworm-security main" >&2
  mv "$tarball.part" "$tarball"
fi
docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["bash"]' "$tarball" "$image" >/dev/null
echo "$image"
