#!/usr/bin/env bash
# One-step set-up on a fresh Debian/Ubuntu machine: the Debian packages the tests use
# (gcc builds the fake driver libraries, prometheus brings prometheus and promtool,
# systemd brings systemd-analyze) and a virtual environment in .venv with gpudiag, its
# jax/iree extras and the test tools. Safe to run again: it only adds what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v gcc >/dev/null || missing+=(gcc libc6-dev)
command -v promtool >/dev/null || missing+=(prometheus)
command -v systemd-analyze >/dev/null || missing+=(systemd)
if ((${#missing[@]})); then
    if [[ $(id -u) -ne 0 ]]; then
        echo "setup: please install: ${missing[*]} (apt-get install, as root)" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 || {
        apt-get update -q >/dev/null
        apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
    }
fi

PYTHON=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
    "$PYTHON" -m venv .venv
fi
# Only reinstall when pyproject.toml changed since the last successful install.
stamp=.venv/.gpudiag-installed
if [[ ! -f $stamp || pyproject.toml -nt $stamp ]]; then
    .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[jax,iree,test]' --config-settings editable_mode=compat \
        2> >(grep -v "^WARNING: Location" >&2)
    touch "$stamp"
fi
