#!/usr/bin/env bash
# Install gpudiag on a node for the systemd unit (docs/operations.md): a virtual environment in
# /opt/gpudiag (the unit's ExecStart runs /opt/gpudiag/bin/gpudiag), the unit, its tmpfiles.d
# file (the shared GPU lock folder /run/gpudiag/locks), the example config (kept when one
# exists), the Slurm scripts and the docs. Kubernetes nodes need none of it: the DaemonSet and
# node-problem-detector's plugin come from gpudiag's image (deploy/kubernetes/).
#
#   scripts/install-node.sh [--wheel FILE] [--find-links DIR] [--extras jax,iree]
#                           [--runtime NAME=PYTHON]... [--prefix /opt/gpudiag] [--root /]
#                           [--no-start]
#
# --runtime: a job environment's interpreter (a venv's, a conda env's bin/python): the daemon
# proves JAX and IREE there, as jobs will run them (docs/operations.md, "Runtimes"); written
# as [runtimes.NAME] into a config this script creates, and checked. The daemon itself needs
# no --extras: jobs' backends are proven in the jobs' environments.
# --wheel: a gpudiag wheel (default: built from this checkout); --find-links: a folder of
# dependency wheels for a node without an index (pip --no-index); --root: where the system
# files go (a staging tree or a machine image's root; the venv always goes to --prefix).
# Run as root on the node. Then: systemctl enable --now gpudiag (done unless --no-start).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
say() { echo "install-node: $*" >&2; }
die() { say "$*"; exit 1; }

wheel="" links="" extras="" prefix=/opt/gpudiag root=/ start=1 runtimes=()
while (($#)); do
    case $1 in
        --wheel) wheel=${2:?}; shift 2 ;;
        --find-links) links=${2:?}; shift 2 ;;
        --extras) extras=${2?}; shift 2 ;;
        --runtime) [[ ${2:-} =~ ^[a-z0-9][a-z0-9_.-]{0,31}=/.+ ]] \
                       || die "--runtime ${2:-}: give NAME=/absolute/path/to/python"
                   runtimes+=("$2"); shift 2 ;;
        --prefix) prefix=${2:?}; shift 2 ;;
        --root) root=${2:?}; shift 2 ;;
        --no-start) start=0; shift ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done
[[ $prefix == /* ]] || die "--prefix $prefix: give an absolute path"
PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import sys, venv; sys.exit(sys.version_info < (3, 10))' 2>/dev/null \
    || die "$PYTHON 3.10+ with the venv module is needed (apt-get install python3 python3-venv)"

if [[ -z $wheel ]]; then
    say "building gpudiag's wheel from $here ..."
    out=$(mktemp -d)
    "$PYTHON" -m pip wheel -q --disable-pip-version-check --no-deps -w "$out" "$here" >&2
    wheel=$(ls "$out"/gpudiag-*.whl)
fi
[[ -f $wheel ]] || die "--wheel $wheel: no such file"

say "installing $(basename "$wheel")${extras:+[$extras]} into $prefix ..."
# pip separately, so that a failure shows ensurepip's own message rather than venv's summary.
"$PYTHON" -m venv --without-pip "$prefix"
"$prefix/bin/python3" -m ensurepip --upgrade --default-pip >/dev/null
pip_args=(-q --disable-pip-version-check)
[[ -n $links ]] && pip_args+=(--no-index --find-links "$links")
"$prefix/bin/pip" install "${pip_args[@]}" "$wheel${extras:+[$extras]}"

unit=$root/etc/systemd/system/gpudiag.service
install -d "$root/etc/systemd/system" "$root/usr/lib/tmpfiles.d" "$root/etc/gpudiag" \
    "$root/usr/share/doc/gpudiag" "$prefix/share/gpudiag"
# The unit names /opt/gpudiag/bin/gpudiag: point it at another prefix when one was given.
sed "s|/opt/gpudiag/bin/gpudiag|$prefix/bin/gpudiag|" "$here/systemd/gpudiag.service" > "$unit"
chmod 0644 "$unit"
install -m 0644 "$here/systemd/gpudiag-tmpfiles.conf" "$root/usr/lib/tmpfiles.d/gpudiag.conf"
if [[ -e $root/etc/gpudiag/gpudiag.toml ]]; then
    say "keeping the existing $root/etc/gpudiag/gpudiag.toml"
else
    install -m 0644 "$here/systemd/gpudiag.toml" "$root/etc/gpudiag/gpudiag.toml"
    for runtime in "${runtimes[@]}"; do
        printf '\n[runtimes.%s]\npython = "%s"\n' "${runtime%%=*}" "${runtime#*=}" \
            >> "$root/etc/gpudiag/gpudiag.toml"
    done
    "$prefix/bin/gpudiag" serve --check-config --config "$root/etc/gpudiag/gpudiag.toml" \
        >/dev/null || die "the config's runtimes were refused (see above)"
fi
((${#runtimes[@]})) && [[ -e $root/etc/gpudiag/gpudiag.toml ]] \
    && ! grep -q '^\[runtimes\.' "$root/etc/gpudiag/gpudiag.toml" \
    && say "kept the existing config: add [runtimes.NAME] to it yourself"
install -m 0644 "$here/docs/operations.md" "$root/usr/share/doc/gpudiag/operations.md"
# The Slurm scripts, for nodes that use them.
cp -r "$here/deploy/slurm" "$prefix/share/gpudiag/"

if [[ $root == / ]]; then
    systemd-tmpfiles --create gpudiag.conf 2>/dev/null \
        || install -d -m 1777 /run/gpudiag/locks
    if [[ -d /run/systemd/system ]]; then
        systemctl daemon-reload
        if ((start)); then
            systemctl enable --now gpudiag
            say "started: systemctl status gpudiag; curl -s localhost:9477/metrics"
        fi
    fi
fi
"$prefix/bin/gpudiag" --version >&2
say "done: $prefix/bin/gpudiag; unit $unit"
