#!/bin/bash
# Slurm HealthCheckProgram: drain a node on which something is broken with
# Reason="gpudiag: <code>", and resume it once gpudiag says healthy again, touching only the
# drains gpudiag made (any other reason is an operator's and is left alone).
#
# It asks the node-health question (`gpudiag health`), not job readiness: GPUs that running
# jobs use are healthy in use, so a busy node is never drained, and gpudiag's probes never
# touch a GPU that a job is using.
#
#   slurm.conf:  HealthCheckProgram=/opt/gpudiag/share/gpudiag/slurm/gpudiag-healthcheck.sh
#                HealthCheckInterval=60   HealthCheckNodeState=ANY
#
# Nodes without GPU GRES are skipped, so one slurm.conf line serves a mixed cluster.
# gpudiag's own failure (exit 2, 3, timeout) changes nothing: unknown is not broken.
# Only the node's own faults drain (device-layer codes: gpudiag_drains); jax and iree in
# GPUDIAG_HEALTH_REQUIRE mean the node's configured runtimes, whose failures are logged
# (and alerted on: GpudiagRuntimeFailing), never drained: software is not a broken node.
set -u
# slurmd gives no PATH: set one before anything else runs, never the caller's (a
# PATH another user set would choose what root runs); the site's defaults file may
# set another (gpudiag-common.sh).
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# shellcheck source-path=SCRIPTDIR source=gpudiag-common.sh
. "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/gpudiag-common.sh"

GPUDIAG_HEALTH_REQUIRE=${GPUDIAG_HEALTH_REQUIRE:-cuda}
node=$(gpudiag_node_name)
gpudiag_installed "health check on $node" || exit 0

if [[ ${GPUDIAG_REQUIRE_GRES:-yes} == yes ]]; then
    if ! "$SCONTROL" show node "$node" 2>/dev/null | grep -Eq '^[[:space:]]*Gres=[^[:space:]]*gpu'; then
        exit 0
    fi
fi

gpudiag_split_require "$GPUDIAG_HEALTH_REQUIRE"
gpudiag_ask health --require "$GPUDIAG_DEVICE_REQUIRE"
if [[ -n $GPUDIAG_SOFTWARE_REQUIRE && ($PREFLIGHT_RC == 0 || $PREFLIGHT_RC == 1) ]]; then
    # shellcheck disable=SC2086  # one word per backend
    gpudiag_runtimes_answer $GPUDIAG_SOFTWARE_REQUIRE
    ((RUNTIMES_RC == 0)) || gpudiag_log "health check on $node: a runtime fails (software: not drained):$RUNTIMES_SAID"
fi
case $PREFLIGHT_RC in
    0) gpudiag_undrain "$node" ;;
    1)
        if gpudiag_not_broken "$PREFLIGHT_CODE"; then
            gpudiag_log "health check on $node: $PREFLIGHT_CODE (nothing known broken), node left as is"
        elif ! gpudiag_drains "$PREFLIGHT_CODE"; then
            gpudiag_log "health check on $node: $PREFLIGHT_CODE is not the node's own fault (software), node left as is"
        else
            gpudiag_drain "$node" "$PREFLIGHT_CODE"
        fi
        ;;
    *) gpudiag_log "health check on $node: gpudiag health exit $PREFLIGHT_RC, node left as is: $PREFLIGHT_ERR" ;;
esac
exit 0
