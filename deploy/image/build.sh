#!/usr/bin/env bash
# The agent's image from Debian's packages, with no registry (what `make image` runs):
#
#   1. a root file system of Debian bookworm's python3 and python3-venv, by mmdebstrap (reproducible:
#      the same packages and BASE_EPOCH give the same tarball, byte for byte), cached under CACHE;
#   2. `podman import` of that tarball as the base image, localhost/vllm-tuner-base:<its sha256>;
#   3. on the host: the pinned dependency wheels of deploy/image/requirements.txt (checked against their
#      hashes) and the tuner's own wheel, built from this tree;
#   4. `podman build` of the Containerfile on that base with those wheels as its only input: pip inside
#      the build installs with --no-index (it reaches nothing), the image gets OCI labels, every file
#      and the image's creation time SOURCE_DATE_EPOCH (the last commit's time): the same tree builds the
#      same image ID again (tests/e2e/test_image.py builds twice, from two caches, and compares).
#
# Environment (all optional):
#   IMAGE           the tag to build (default vllm-tuner:<version>)
#   PODMAN          the podman command line, e.g. "podman --root /var/tmp/storage" (default podman)
#   PYTHON          a Python with pip, to build the wheels (default .venv/bin/python, then python3)
#   DEBIAN_MIRROR   the Debian archive (default http://deb.debian.org/debian); a snapshot.debian.org URL
#                   (e.g. http://snapshot.debian.org/archive/debian/20250520T000000Z) pins every package
#   DEBIAN_SECURITY the security archive (default http://deb.debian.org/debian-security); "none": leave out
#   BASE_EPOCH      the base file system's timestamps (default 1747699200, 2025-05-20)
#   SOURCE_DATE_EPOCH  the image's timestamps (default the last commit's time)
#   CACHE           where the root file systems and wheels are kept (default .cache/image)
#
# Only x86_64 (amd64) hosts: the two compiled wheels in requirements.txt are x86_64 ones.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$REPO/pyproject.toml")
IMAGE=${IMAGE:-vllm-tuner:$VERSION}
read -ra PODMAN_CMD <<<"${PODMAN:-podman}"
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
# absolute: the wheel is built from a copy of the tree in another directory (`make image` passes .venv/bin/python)
case $PYTHON in */*) PYTHON=$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON") ;; esac
SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY=${DEBIAN_SECURITY:-http://deb.debian.org/debian-security}
BASE_EPOCH=${BASE_EPOCH:-1747699200}
CACHE=${CACHE:-$REPO/.cache/image}
PACKAGES=python3,python3-venv
if [ -z "${SOURCE_DATE_EPOCH:-}" ]; then
  SOURCE_DATE_EPOCH=$(git -C "$REPO" log -1 --format=%ct 2>/dev/null || echo "$BASE_EPOCH")
fi
export SOURCE_DATE_EPOCH
REVISION=$(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)
if [ "$REVISION" != unknown ] && [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  REVISION="$REVISION-dirty"
fi

say() { echo "image: $*" >&2; }
die() { echo "error: $*" >&2; exit 1; }

[ "$(uname -m)" = x86_64 ] || die "only x86_64 hosts are supported (requirements.txt pins x86_64 wheels); this is $(uname -m)"

# --- the tools: mmdebstrap and podman from Debian, installed when missing (as root) ---------------------
missing=""
command -v mmdebstrap >/dev/null 2>&1 || missing="$missing mmdebstrap"
command -v "${PODMAN_CMD[0]}" >/dev/null 2>&1 || missing="$missing podman"
if [ -n "$missing" ]; then
  [ "$(id -u)" = 0 ] || die "missing:$missing: install them (apt-get install$missing) or run as root"
  say "installing$missing"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq $missing
fi
[ "$(id -u)" = 0 ] || die "the build runs as root (mmdebstrap's root mode, podman's chroot isolation)"

mkdir -p "$CACHE"

# --- 1. the base root file system --------------------------------------------------------------------
sources=("deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main")
[ "$SECURITY" = none ] || sources+=("deb $SECURITY $SUITE-security main")
mmdebstrap_version=$(mmdebstrap --version | awk '{print $2}')
key=$(printf '%s\n' "$SUITE" "$PACKAGES" "$BASE_EPOCH" "$mmdebstrap_version" "${sources[@]}" | sha256sum | cut -c1-16)
rootfs="$CACHE/rootfs-$SUITE-$key.tar"
if [ ! -s "$rootfs" ]; then
  say "mmdebstrap $SUITE ($PACKAGES) from $MIRROR"
  start=$(date +%s)
  # --variant=essential: Debian's Essential set (dpkg, coreutils, dash...) and what python3 needs; no apt.
  # Docs, manuals and translations are left out. The archives apt downloaded are not kept in the tarball.
  SOURCE_DATE_EPOCH=$BASE_EPOCH mmdebstrap --quiet --mode=root --format=tar --variant=essential \
    --include="$PACKAGES" \
    --aptopt='Acquire::Check-Valid-Until "false"' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    "$SUITE" "$rootfs.part" "${sources[@]}"
  mv "$rootfs.part" "$rootfs"
  say "root file system in $(( $(date +%s) - start )) s: $rootfs"
fi
rootfs_sha=$(sha256sum "$rootfs" | cut -d' ' -f1)

# --- 2. the base image ---------------------------------------------------------------------------------
base="localhost/vllm-tuner-base:$SUITE-${rootfs_sha:0:16}"
if ! "${PODMAN_CMD[@]}" image exists "$base"; then
  say "podman import $rootfs as $base"
  "${PODMAN_CMD[@]}" import --quiet --change 'CMD ["/usr/bin/python3"]' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --message "mmdebstrap $SUITE $PACKAGES, rootfs sha256:$rootfs_sha" "$rootfs" "$base" >/dev/null
fi

# --- 3. the wheels, on the host ------------------------------------------------------------------------
context="$CACHE/context"
rm -rf "$context" && mkdir -p "$context/wheels"
lock="$REPO/deploy/image/requirements.txt"
deps="$CACHE/wheels-$(sha256sum "$lock" | cut -c1-16)"
if [ ! -d "$deps" ]; then
  say "downloading the pinned wheels of deploy/image/requirements.txt"
  "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --require-hashes \
    --only-binary=:all: --python-version 3.11 --implementation cp --abi cp311 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$deps.part" -r "$lock" 2>"$CACHE/pip.log" \
    || { grep -v "^WARNING: Location" "$CACHE/pip.log" >&2; die "the wheels of $lock could not be downloaded"; }
  mv "$deps.part" "$deps"
fi
cp "$deps"/*.whl "$context/wheels/"
cp "$lock" "$context/requirements.txt"
say "building the tuner's wheel from $REPO"
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
# A copy of what the wheel is made of: setuptools writes build/ and *.egg-info next to its input.
cp -r "$REPO/pyproject.toml" "$REPO/README.md" "$REPO/tuner" "$build/"
find "$build" -name __pycache__ -prune -exec rm -rf {} +
# With the build tools the Python has (a project virtualenv has them), else pip fetches them on the host.
(cd "$build" && { "$PYTHON" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation \
  --no-index -w "$context/wheels" . 2>/dev/null \
  || "$PYTHON" -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$context/wheels" .; })
[ -n "$(ls "$context"/wheels/vllm_tuner_sidecar-*.whl 2>/dev/null)" ] || die "the tuner's wheel was not built"

# --- 4. the image --------------------------------------------------------------------------------------
created=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)
say "podman build $IMAGE on $base"
# --isolation chroot: RUN needs no OCI runtime and no cgroups (it runs where crun cannot, as on a VM with a
# hybrid cgroup tree); its network is podman's, which `unshare --net` makes one with no interface up:
# nothing in the build can reach out. --omit-history and --timestamp:
# no build-time clock in the image, so the same inputs give the same image ID.
unshare --net -- "${PODMAN_CMD[@]}" build --quiet --no-cache --layers=false --isolation chroot --omit-history \
  --timestamp "$SOURCE_DATE_EPOCH" -f "$REPO/Containerfile" \
  --build-arg "BASE_IMAGE=$base" --build-arg "SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH" \
  --label "org.opencontainers.image.version=$VERSION" \
  --label "org.opencontainers.image.revision=$REVISION" \
  --label "org.opencontainers.image.created=$created" \
  --label "org.opencontainers.image.base.name=debian:$SUITE (mmdebstrap $PACKAGES, rootfs sha256:$rootfs_sha)" \
  -t "$IMAGE" "$context" >/dev/null
id=$("${PODMAN_CMD[@]}" image inspect "$IMAGE" --format '{{.Id}}')
say "$IMAGE: image ID sha256:$id"
echo "$id"
