#!/bin/bash
# Slurm Prolog: refuse a job on a node whose GPUs are blocked for it, and write the verdict
# into the job's record.
#
#   slurm.conf:  Prolog=/opt/gpudiag/share/gpudiag/slurm/gpudiag-prolog.sh
#                (gpudiag-common.sh next to it; gres.conf with AutoDetect=nvml so that
#                SLURM_JOB_GPUS indices are NVML's)
#
# Outcome, from `gpudiag preflight`'s exit code for the node's own part of
# GPUDIAG_PROLOG_REQUIRE (cuda, nvml):
#   0 ready    the job runs; the job record gets "gpudiag: none ...".
#   1 blocked  by the node's own fault (a device-layer code: gpudiag_drains): the job is
#              refused (exit 1: a batch job is requeued, srun fails); the node is drained
#              with Reason="gpudiag: <code>" (Slurm would otherwise drain it with "Prolog
#              error") so the health check can undrain it once it recovers.
#              Any other code (software, requirement, admission) never drains: the Prolog
#              exits 0 (a failing Prolog drains the node) and, unless the code says only
#              "not proven now" (backend_unproven, devices_busy, lock_timeout), cancels the
#              job (GPUDIAG_ON_SOFTWARE=cancel, the default; allow lets it run).
#   2, 3, timeout  gpudiag itself could not answer: logged and recorded; the job runs
#              unless GPUDIAG_ON_ERROR=refuse (a broken gpudiag must not stop a fleet).
# jax and iree in GPUDIAG_PROLOG_REQUIRE mean the node's configured runtimes (the job's own
# environment does not exist yet): every runtime that promises the backend failing cancels
# the job as above, never a drain; no runtime promising it means not checked.
set -u
# slurmd gives no PATH: set one before anything else runs, never the caller's (a
# PATH another user set would choose what root runs); the site's defaults file may
# set another (gpudiag-common.sh).
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# shellcheck source-path=SCRIPTDIR source=gpudiag-common.sh
. "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/gpudiag-common.sh"

GPUDIAG_PROLOG_REQUIRE=${GPUDIAG_PROLOG_REQUIRE:-cuda}
# Where the verdict goes in the job's record: AdminComment (users cannot edit it),
# Comment, or none. Optional: GPUDIAG_RECORD_DIR keeps the full JSON per job.
GPUDIAG_JOB_FIELD=${GPUDIAG_JOB_FIELD:-AdminComment}
GPUDIAG_ON_ERROR=${GPUDIAG_ON_ERROR:-allow}
GPUDIAG_ON_SOFTWARE=${GPUDIAG_ON_SOFTWARE:-cancel}

job_gpus=${SLURM_JOB_GPUS:-}
# Not a GPU job: nothing to check, no RPC, no delay.
[[ -n $job_gpus ]] || exit 0
job=${SLURM_JOB_ID:-0}
node=$(gpudiag_node_name)
count=$(tr ',' '\n' <<<"$job_gpus" | grep -c .)

# The Prolog runs outside the job's cgroup and sees every GPU; SLURM_JOB_GPUS are indices
# among all of them, so a CUDA_VISIBLE_DEVICES inherited here must not narrow them again.
unset CUDA_VISIBLE_DEVICES NVIDIA_VISIBLE_DEVICES
gpudiag_split_require "$GPUDIAG_PROLOG_REQUIRE"
args=(--require "$GPUDIAG_DEVICE_REQUIRE" --devices "$job_gpus" --min-devices "$count")
[[ -n ${GPUDIAG_RECORD_DIR:-} ]] && args+=(--record "$GPUDIAG_RECORD_DIR/job-$job.json")
gpudiag_preflight "${args[@]}"

record_job() {
    [[ $GPUDIAG_JOB_FIELD == none ]] && return 0
    "$SCONTROL" update JobId="$job" "$GPUDIAG_JOB_FIELD=$1" \
        || gpudiag_log "job $job: could not write $GPUDIAG_JOB_FIELD"
}

# refuse_software CODE: a software code refuses the job without draining the node: the
# Prolog exits 0 (a failing Prolog drains it) and the job is cancelled.
refuse_software() {
    [[ $GPUDIAG_ON_SOFTWARE == cancel ]] || return 0
    gpudiag_log "job $job on $node: $1 is software (the node is not drained): cancelling the job"
    "$SCANCEL" "$job" || gpudiag_log "job $job: could not cancel it"
}

case $PREFLIGHT_RC in
    0)
        runtimes=""
        if [[ -n $GPUDIAG_SOFTWARE_REQUIRE ]]; then
            # shellcheck disable=SC2086  # one word per backend
            gpudiag_ask_runtimes $GPUDIAG_SOFTWARE_REQUIRE
            runtimes=${RUNTIMES_SAID# }
            runtimes=" runtimes=${runtimes// /,}"
            if ((RUNTIMES_RC == 1)); then
                record_job "gpudiag: $RUNTIMES_CODE ready=false gpus=$job_gpus software=yes checked_at=$(gpudiag_kv checked_at) source=$(gpudiag_kv source)$runtimes"
                gpudiag_log "job $job on $node: the node's runtimes cannot serve it:$RUNTIMES_SAID"
                refuse_software "$RUNTIMES_CODE"
                exit 0
            fi
        fi
        record_job "gpudiag: none ready=true gpus=$job_gpus checked_at=$(gpudiag_kv checked_at) source=$(gpudiag_kv source)$runtimes"
        exit 0
        ;;
    1)
        message=$(gpudiag_kv blockers.0.message | cut -c 1-200)
        if gpudiag_not_broken "$PREFLIGHT_CODE"; then
            record_job "gpudiag: $PREFLIGHT_CODE ready=false gpus=$job_gpus not_broken=yes checked_at=$(gpudiag_kv checked_at) source=$(gpudiag_kv source) message=$message"
            gpudiag_log "job $job on $node: $PREFLIGHT_CODE, nothing known broken: the job runs ($message)"
            exit 0
        fi
        if ! gpudiag_drains "$PREFLIGHT_CODE"; then
            record_job "gpudiag: $PREFLIGHT_CODE ready=false gpus=$job_gpus software=yes checked_at=$(gpudiag_kv checked_at) source=$(gpudiag_kv source) blockers=$(gpudiag_kv blockers) message=$message"
            refuse_software "$PREFLIGHT_CODE"
            exit 0
        fi
        record_job "gpudiag: $PREFLIGHT_CODE ready=false gpus=$job_gpus checked_at=$(gpudiag_kv checked_at) source=$(gpudiag_kv source) blockers=$(gpudiag_kv blockers) message=$message"
        gpudiag_log "job $job refused on $node: $PREFLIGHT_CODE ($message)"
        gpudiag_drain "$node" "$PREFLIGHT_CODE"
        exit 1
        ;;
    *)
        record_job "gpudiag: unknown preflight_exit=$PREFLIGHT_RC"
        gpudiag_log "job $job on $node: gpudiag preflight exit $PREFLIGHT_RC: $PREFLIGHT_ERR"
        [[ $GPUDIAG_ON_ERROR == refuse ]] && exit 1
        exit 0
        ;;
esac
