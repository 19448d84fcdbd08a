#!/bin/bash
# node-problem-detector custom plugin: is anything on this node's GPU stack broken, per gpudiag?
# It asks the node-health question (`gpudiag health`): GPUs that pods use are healthy in use,
# so a busy node never turns GPUBlocked.
#
# NPD's exit-code protocol: 0 OK, 1 NonOK (the GPUBlocked condition turns True), 2 Unknown.
# The first line of stdout is the condition's message ("gpudiag: <code>").
# gpudiag health's exit codes map as: 0 ready -> 0, 1 blocked -> 1 (backend_unproven -> 2:
# nothing known broken), anything else
# (2 usage, 3 gpudiag failed, a timeout) -> 2: gpudiag not answering is not a broken GPU.
#
# It asks the local gpudiag daemon on its unix socket (the DaemonSet's hostPath
# /run/gpudiag/daemon: mount it into the NPD container too), which answers from its cache in
# milliseconds; an answer there is trusted only from the daemon's user (the folder's
# owner), and preflight falls back to probing inline when none answers. The daemon's TCP
# port is read-only: it refuses /v1/preflight. GPUDIAG must name a gpudiag the NPD
# container can run (e.g. the host's /opt/gpudiag mounted read-only).
set -u
GPUDIAG=${GPUDIAG:-/opt/gpudiag/bin/gpudiag}
export GPUDIAG_DAEMON_URL=${GPUDIAG_DAEMON_URL:-unix:/run/gpudiag/daemon/gpudiag.sock}
# Inside NPD's 50 s rule timeout.
GPUDIAG_TIMEOUT_S=${GPUDIAG_TIMEOUT_S:-40}

kv=$(timeout --kill-after=5 "$GPUDIAG_TIMEOUT_S" "$GPUDIAG" health --format kv \
    --require "${GPUDIAG_NPD_REQUIRE:-cuda}" --timeout 20 2>/dev/null)
rc=$?
code=$(sed -n 's/^gpu_validation_blocker=//p' <<<"$kv" | head -n 1)
case $rc in
    0) echo "gpudiag: ready"; exit 0 ;;
    # Not proven now (every GPU held by pods) is not broken: Unknown, never GPUBlocked.
    1) if [[ $code == backend_unproven ]]; then echo "gpudiag: backend_unproven (nothing known broken)"; exit 2; fi
       echo "gpudiag: ${code:-unknown}"; exit 1 ;;
    124|137) echo "gpudiag: health check timed out after ${GPUDIAG_TIMEOUT_S}s"; exit 2 ;;
    *) echo "gpudiag: health check failed (exit $rc)"; exit 2 ;;
esac
