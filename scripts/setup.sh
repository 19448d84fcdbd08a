#!/usr/bin/env bash
# One-step set-up on a fresh Debian/Ubuntu machine: the Debian packages the tests use
# (gcc builds the fake driver libraries, prometheus brings prometheus and promtool,
# systemd brings systemd-analyze, slurm-wlm and munge run the real single-node Slurm cluster
# of tests/test_slurm.py; buildah, podman, runc, mmdebstrap and systemd-container the deployment
# tiers; nothing auto-starts) and a virtual environment in .venv with gpudiag, its
# jax/iree extras and the test tools. Safe to run again: it only adds what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "setup: $*" >&2; }

missing=()
command -v gcc >/dev/null || missing+=(gcc libc6-dev)
command -v promtool >/dev/null || missing+=(prometheus)
command -v systemd-analyze >/dev/null || missing+=(systemd)
# The real Slurm cluster tests need root anyway (mknod of GRES device files): a plain user
# without them gets those tests skipped with a reason, not a failed set-up.
slurm=()
command -v slurmctld >/dev/null && command -v slurmd >/dev/null || slurm+=(slurm-wlm)
command -v munged >/dev/null && command -v mungekey >/dev/null || slurm+=(munge)
if ((${#slurm[@]})); then
    if [[ $(id -u) -eq 0 ]]; then
        missing+=("${slurm[@]}")
    else
        echo "setup: the real Slurm cluster tests will skip: install ${slurm[*]} as root" >&2
    fi
fi
# The deployment tiers (tests/test_container.py, tests/test_nspawn.py) build the image with
# buildah, run it with podman (runc), and boot the unit in a Debian rootfs from mmdebstrap
# under systemd-nspawn. Root only, like Slurm's: as root a missing tool fails those tests.
deploy=()
for tool in buildah:buildah podman:podman runc:runc mmdebstrap:mmdebstrap \
            systemd-nspawn:systemd-container; do
    command -v "${tool%%:*}" >/dev/null || deploy+=("${tool#*:}")
done
if ((${#deploy[@]})); then
    if [[ $(id -u) -eq 0 ]]; then
        missing+=("${deploy[@]}")
    else
        echo "setup: the deployment tiers will skip: install ${deploy[*]} as root" >&2
    fi
fi
if ((${#missing[@]})); then
    if [[ $(id -u) -ne 0 ]]; then
        echo "setup: please install: ${missing[*]} (apt-get install, as root)" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    say "installing Debian packages: ${missing[*]} ..."
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 || {
        apt-get update -q >/dev/null
        apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
    }
fi

PYTHON=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
    say "creating the virtual environment .venv with $PYTHON ..."
    "$PYTHON" -m venv .venv
fi
# Only reinstall when pyproject.toml changed since the last successful install.
stamp=.venv/.gpudiag-installed
if [[ ! -f $stamp || pyproject.toml -nt $stamp ]]; then
    say "installing gpudiag with its jax, iree and test extras into .venv (about a minute) ..."
    .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[jax,iree,test]' --config-settings editable_mode=compat \
        2> >(grep -v "^WARNING: Location" >&2)
    touch "$stamp"
else
    say ".venv is up to date (pyproject.toml unchanged since the last install)"
fi
say "done: .venv/bin/gpudiag probe; no GPU? see docs/try-without-a-gpu.md"

