#!/usr/bin/env bash
# One-step set-up on a fresh Debian/Ubuntu machine. Safe to run again: it only adds what is
# missing.
#
#   scripts/setup.sh           what probing needs: a virtual environment in .venv with gpudiag
#                              and its jax and iree extras (and gcc, which builds the fake
#                              driver of docs/try-without-a-gpu.md)
#   scripts/setup.sh --tests   what the test suite needs besides: the test extra and, as root,
#                              the Debian packages the tests use (prometheus brings prometheus
#                              and promtool, systemd brings systemd-analyze, slurm-wlm and
#                              munge run the real single-node Slurm cluster of
#                              tests/test_slurm.py; buildah, podman, runc, mmdebstrap and
#                              systemd-container the deployment tiers; nothing auto-starts)
#
# Another apt or dpkg running (unattended-upgrades on a fresh cloud machine) is waited for,
# at most SETUP_APT_WAIT_S seconds (default 600), with a message (scripts/apt_lock.py).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "setup: $*" >&2; }

tests=no
case ${1:-} in
    "") ;;
    --tests) tests=yes ;;
    -h|--help) sed -n '2,16s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) say "unknown option ${1}: use no option (probing) or --tests (the test suite)"; exit 2 ;;
esac
root=no
[[ $(id -u) -ne 0 ]] || root=yes

missing=()
gcc=()
command -v gcc >/dev/null || gcc=(gcc libc6-dev)
if [[ $tests == yes ]]; then
    missing+=("${gcc[@]}")
    command -v promtool >/dev/null || missing+=(prometheus)
    command -v systemd-analyze >/dev/null || missing+=(systemd)
    # The real Slurm cluster tests need root anyway (mknod of GRES device files): a plain
    # user without them gets those tests skipped with a reason, not a failed set-up.
    slurm=()
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null || slurm+=(slurm-wlm)
    command -v munged >/dev/null && command -v mungekey >/dev/null || slurm+=(munge)
    # The deployment tiers (tests/test_container.py, tests/test_nspawn.py) build the image
    # with buildah, run it with podman (runc), and boot the unit in a Debian rootfs from
    # mmdebstrap under systemd-nspawn. Root only, like Slurm's: as root a missing tool fails
    # those tests.
    deploy=()
    for tool in buildah:buildah podman:podman runc:runc mmdebstrap:mmdebstrap \
                systemd-nspawn:systemd-container; do
        command -v "${tool%%:*}" >/dev/null || deploy+=("${tool#*:}")
    done
    if ((${#slurm[@]})); then
        if [[ $root == yes ]]; then
            missing+=("${slurm[@]}")
        else
            say "the real Slurm cluster tests will skip: install ${slurm[*]} as root"
        fi
    fi
    if ((${#deploy[@]})); then
        if [[ $root == yes ]]; then
            missing+=("${deploy[@]}")
        else
            say "the deployment tiers will skip: install ${deploy[*]} as root"
        fi
    fi
elif ((${#gcc[@]})); then
    # Probing needs no compiler; the fake host of docs/try-without-a-gpu.md does.
    if [[ $root == yes ]]; then
        missing+=("${gcc[@]}")
    else
        say "gcc is missing: the fake GPU host (python -m tests.fakes) needs it; install ${gcc[*]} as root"
    fi
fi
if ((${#missing[@]})); then
    if [[ $root == no ]]; then
        say "please install: ${missing[*]} (apt-get install, as root)"
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    wait_s=${SETUP_APT_WAIT_S:-600}
    # Another apt (unattended-upgrades) first: waited for, with a message and a bound.
    python3 scripts/apt_lock.py --wait "$wait_s" || exit 1
    # And apt's own wait for the lock, should one start between that check and ours.
    apt=(apt-get -o "DPkg::Lock::Timeout=$wait_s" -y -q)
    say "installing Debian packages: ${missing[*]} ..."
    "${apt[@]}" install --no-install-recommends "${missing[@]}" >/dev/null 2>&1 || {
        "${apt[@]}" update >/dev/null
        "${apt[@]}" install --no-install-recommends "${missing[@]}" >/dev/null
    }
fi

PYTHON=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
    say "creating the virtual environment .venv with $PYTHON ..."
    "$PYTHON" -m venv .venv
fi
# The stamp holds the extras installed; an install is redone when pyproject.toml changed
# since, or when this mode wants an extra the last one did not install. A stamp without
# extras is from before the two modes: it installed them all.
extras=jax,iree
[[ $tests == no ]] || extras=jax,iree,test
stamp=.venv/.gpudiag-installed
have=$(cat "$stamp" 2>/dev/null || true)
[[ -n $have || ! -f $stamp ]] || have=jax,iree,test
if [[ ! -f $stamp || pyproject.toml -nt $stamp || ( $tests == yes && $have != *test* ) ]]; then
    [[ $have != *test* ]] || extras=jax,iree,test  # never take an extra away
    say "installing gpudiag with its ${extras//,/, } extras into .venv (about a minute) ..."
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$extras]" \
        --config-settings editable_mode=compat 2> >(grep -v "^WARNING: Location" >&2)
    echo "$extras" > "$stamp"
else
    say ".venv is up to date (pyproject.toml unchanged since the last install)"
fi
if [[ $tests == yes ]]; then
    say "done: .venv/bin/python -m pytest -q -p no:cacheprovider -n auto --dist loadgroup (GPUDIAG_REAL_JAX=0 skips the 5.5 GB real JAX CUDA tier)"
else
    say "done: .venv/bin/gpudiag probe; no GPU? see docs/try-without-a-gpu.md"
fi
