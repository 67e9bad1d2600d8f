#!/usr/bin/env bash
# `make images`: ingero-agent and ingero-operator (Dockerfile.agent, Dockerfile.operator),
# tagged with the package version (pyproject.toml). Starts a docker daemon when none runs
# (scripts/docker-daemon.sh) and builds on a Debian base made here (scripts/base-image.sh),
# so nothing is pulled from an image registry. Prints the two image names.
#   IMAGE_REGISTRY  name prefix, e.g. ghcr.io/you (then `docker push` them); default: none
#   BASE_IMAGE      build on this Debian bookworm image instead (e.g. debian:bookworm-slim,
#                   pulled from Docker Hub)
set -euo pipefail
cd "$(dirname "$0")/.."
# One build at a time per machine (the images suite's two pytest workers both ask): a second
# caller waits, then finds everything cached.
lock=${INGERO_CACHE:-$HOME/.cache/ingero}/images/.lock
mkdir -p "${lock%/*}"
exec 9>"$lock"
flock 9
version=$(/usr/bin/python3 scripts/release.py version)
bash scripts/docker-daemon.sh 9>&-     # a dockerd it starts must not hold the lock for its life
base=${BASE_IMAGE:-$(bash scripts/base-image.sh)}
prefix=${IMAGE_REGISTRY:+${IMAGE_REGISTRY%/}/}
for component in agent operator; do
  image=${prefix}ingero-$component:$version
  echo "images: building $image on $base" >&2
  docker build --network host --build-arg BASE_IMAGE="$base" -f "Dockerfile.$component" -t "$image" . >&2
  echo "$image"
done
