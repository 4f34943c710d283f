#!/usr/bin/env bash
# Build the cpuserve image with podman on a machine without a reachable registry (Debian's podman
# as root; ../shared/containers.md's recipe): a Debian bookworm base made by debootstrap, the
# cpuserve wheel (kernels inside) and torch's CPU wheel in the context. Elsewhere, build the same
# Containerfile FROM a public base: `podman build --build-arg BASE=python:3.11-slim-bookworm ...`.
#   container/build.sh [TAG]        (default localhost/cpuserve:latest)
# Prints the timings; the podman settings live in $CPUSERVE_PODMAN_DIR (default /var/tmp/cpuserve-podman).
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=${1:-localhost/cpuserve:latest}
W=${CPUSERVE_PODMAN_DIR:-/var/tmp/cpuserve-podman}
PY=.venv/bin/python
t0=$(date +%s)
unavailable() { echo "[image] podman is not available here: $1" >&2; exit 3; }
if ! command -v podman >/dev/null || ! command -v debootstrap >/dev/null; then
    { apt-get update -qq && apt-get install -y -qq podman buildah runc debootstrap >/dev/null; } \
        || unavailable "apt-get could not install podman, runc and debootstrap"
fi
mkdir -p "$W/tmp"
cat > "$W/containers.conf" <<'CONF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
printf '[storage]\ndriver = "overlay"\ngraphroot = "%s/storage"\nrunroot = "%s/runroot"\n' "$W" "$W" > "$W/storage.conf"
export CONTAINERS_CONF=$W/containers.conf CONTAINERS_STORAGE_CONF=$W/storage.conf TMPDIR=$W/tmp
if ! podman image exists localhost/debian-base:bookworm; then
    MIRROR=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources)
    rm -rf "$W/rootfs"
    debootstrap --variant=minbase bookworm "$W/rootfs" "$MIRROR" >/dev/null || unavailable "debootstrap failed"
    rm -rf "$W/rootfs"/var/lib/apt/lists/* "$W/rootfs"/var/cache/apt/archives/*.deb
    cp /etc/apt/sources.list.d/debian.sources "$W/rootfs/etc/apt/sources.list.d/"
    tar -C "$W/rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - localhost/debian-base:bookworm >/dev/null \
        || unavailable "podman import failed"
    rm -rf "$W/rootfs"
fi
podman run --rm --network host localhost/debian-base:bookworm true >/dev/null 2>&1 \
    || unavailable "podman cannot start a container (runtime, cgroups or rlimits)"
t1=$(date +%s)
CTX="$W/context"
rm -rf "$CTX" && mkdir -p "$CTX/wheels"
cp container/Containerfile "$CTX/"
"$PY" -m pip download --quiet --no-deps -d "$CTX/wheels" torch==2.13.0 2>&1 | grep -v "is ignored" >&2 || true
"$PY" -m pip wheel --quiet . --no-build-isolation --no-deps -w "$CTX/wheels" 2>&1 | grep -v "is ignored" >&2 || true
ls "$CTX"/wheels/cpuserve-*.whl "$CTX"/wheels/torch-*.whl >/dev/null
podman build --quiet --format docker --network host \
    -v /etc/ssl/certs/ca-certificates.crt:/run/host-ca.crt:ro \
    --build-arg BASE=localhost/debian-base:bookworm -t "$TAG" "$CTX" >/dev/null
t2=$(date +%s)
size=$(podman image inspect "$TAG" --format '{{.Size}}')
echo "[image] $TAG: base $((t1 - t0)) s, build $((t2 - t1)) s, size $((size / 1000000)) MB" >&2
