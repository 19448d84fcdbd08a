#!/usr/bin/env bash
# Build gpudiag's container image with buildah from this checkout (docs/operations.md).
#
#   scripts/build-image.sh [--flavour slim|full] [--base IMAGE|debian] [--tag TAG]
#
# slim (default): the daemon with the host, nvml and cuda probes; full adds the jax and iree
# extras. --base names the base image (a Debian bookworm with python3 and python3-venv); the
# default is the official Python image when a registry answers, else "debian": a rootfs
# made by mmdebstrap from Debian's packages (cached in .cache/image/), imported as
# localhost/gpudiag-base:bookworm. The tag defaults to localhost/gpudiag:VERSION (-full for
# the full flavour), the name deploy/kubernetes/daemonset.yaml uses.
# Needs: buildah (and mmdebstrap for --base debian), python3 with pip, root or a user
# namespace for buildah.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "build-image: $*" >&2; }
die() { say "$*"; exit 1; }

flavour=slim base="" tag=""
while (($#)); do
    case $1 in
        --flavour) flavour=${2:?--flavour needs slim or full}; shift 2 ;;
        --base) base=${2:?--base needs an image or debian}; shift 2 ;;
        --tag) tag=${2:?--tag needs a name}; shift 2 ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) die "unknown argument $1 (accepted: --flavour slim|full, --base IMAGE|debian, --tag TAG)" ;;
    esac
done
case $flavour in
    slim) extras="" ;;
    full) extras="jax,iree" ;;
    *) die "--flavour $flavour: accepted slim or full" ;;
esac
command -v buildah >/dev/null || die "buildah is not installed (apt-get install buildah)"
PYTHON=${PYTHON:-python3}
version=$("$PYTHON" -c 'import re,sys; print(re.search(r"^version = \"([^\"]+)\"", open("pyproject.toml").read(), re.M).group(1))')
tag=${tag:-localhost/gpudiag:$version${extras:+-full}}
cache=.cache/image
mkdir -p "$cache"

if [[ -z $base ]]; then
    # A registry that answers a manifest request within 10 s: use the official Python image.
    if timeout 10 buildah pull -q python:3.11-slim-bookworm >/dev/null 2>&1; then
        base=python:3.11-slim-bookworm
    else
        say "no registry base image reachable: using a Debian rootfs from mmdebstrap"
        base=debian
    fi
fi
if [[ $base == debian ]]; then
    command -v mmdebstrap >/dev/null || die "mmdebstrap is not installed (apt-get install mmdebstrap)"
    rootfs=$cache/debian-bookworm-python.tar
    if [[ ! -f $rootfs ]]; then
        say "making a Debian bookworm rootfs with python3 (mmdebstrap, about a minute) ..."
        # The host's apt sources when it is Debian (a mirror it can reach), else Debian's own.
        sources=()
        [[ -f /etc/apt/sources.list.d/debian.sources ]] && sources=(/etc/apt/sources.list.d/debian.sources)
        # shellcheck disable=SC2016  # mmdebstrap itself expands "$1" (the rootfs) in hooks
        mmdebstrap --quiet --format=tar --variant=minbase --include=python3,python3-venv,ca-certificates \
            --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
            --dpkgopt='path-exclude=/usr/share/locale/*' \
            --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
            bookworm "$rootfs.tmp" "${sources[@]}"
        mv "$rootfs.tmp" "$rootfs"
    fi
    base=localhost/gpudiag-base:bookworm
    if ! buildah inspect --type image "$base" >/dev/null 2>&1 \
            || [[ $rootfs -nt $cache/base-imported ]]; then
        say "importing the rootfs as $base ..."
        ctr=$(buildah from scratch)
        buildah add --quiet "$ctr" "$rootfs" / >/dev/null
        buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
            --cmd /bin/bash "$ctr"
        buildah commit --quiet --rm "$ctr" "$base" >/dev/null
        touch "$cache/base-imported"
    fi
fi

# The build context: the Containerfile, a wheel folder (gpudiag and every dependency), so
# that the build itself needs no network, and node-problem-detector's plugin (npd/).
context=$cache/context
rm -rf "$context"
mkdir -p "$context/wheels" "$context/npd"
cp Containerfile "$context/"
cp deploy/kubernetes/npd/gpudiag-npd.sh deploy/kubernetes/npd/gpudiag-plugin.json "$context/npd/"
say "building gpudiag's wheel and collecting its dependencies${extras:+ with [$extras]} ..."
"$PYTHON" -m pip wheel -q --disable-pip-version-check --no-deps -w "$context/wheels" . \
    2> >(grep -v "^WARNING: Location" >&2)
wheel=$(ls "$context"/wheels/gpudiag-*.whl)
"$PYTHON" -m pip wheel -q --disable-pip-version-check -w "$context/wheels" \
    "$wheel${extras:+[$extras]}" 2> >(grep -v "^WARNING: Location" >&2)

say "building $tag from $base ..."
old_id=$(buildah inspect --type image --format '{{.FromImageID}}' "$tag" 2>/dev/null || true)
buildah bud --quiet --layers=false -f "$context/Containerfile" --build-arg "BASE=$base" \
    --build-arg "EXTRAS=$extras" -t "$tag" "$context" >/dev/null
# The image this tag named before is left untagged: remove it unless something uses it.
if [[ -n $old_id && $old_id != $(buildah inspect --type image --format '{{.FromImageID}}' "$tag") ]]; then
    buildah rmi "$old_id" >/dev/null 2>&1 || true
fi
size=$(podman image inspect --format '{{.Size}}' "$tag" 2>/dev/null || true)
say "built $tag${size:+ ($((size / 1000000)) MB)}"
echo "$tag"
