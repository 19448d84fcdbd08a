#!/bin/bash
# Slurm Epilog: after a GPU job, say whether the GPU failed it; drain the node on hardware only.
#
#   slurm.conf:  Epilog=/opt/gpudiag/share/gpudiag/slurm/gpudiag-epilog.sh
#                (gpudiag-common.sh next to it)
#
# The answer is `gpudiag explain --slurm-job $SLURM_JOB_ID`: every `gpudiag run` inside the
# job reported its failure attribution to the node's daemon state dir (job-closeouts/, kept
# in the history), with the events that decided it. Outcome:
#   hardware     an XID, lost GPU or uncorrectable ECC on the job's GPUs: the node is
#                drained with Reason="gpudiag: <code> during job <id>" and the explanation
#                is recorded (below). The health check undoes a gpudiag drain only once the
#                node is ready again (with the daemon, a held XID keeps it blocked until
#                `gpudiag clear`).
#                Only on a window the kernel attests (issue 38): a run that announced itself
#                to the daemon on its socket (peer credentials, its GPU locks), or a record
#                root wrote; a record any user could write never drains a node.
#   software, unknown   recorded, no drain (a broken stack is the health check's to drain).
#   application  nothing: the job's own failure is not the node's business.
#   no run of the job reported, or gpudiag failed: logged, nothing else.
# Where the explanation goes: GPUDIAG_RECORD_DIR/job-<id>-explain.json (the whole answer with
# its timeline, beside the Prolog's job-<id>.json verdict) and syslog (the one-line form). The
# job's AdminComment cannot take it: slurmctld refuses updates of a finished job ("Job has
# already finished"), and an Epilog runs after the job finished. The drain reason names the
# job, so `sinfo -R` leads to the record.
# An Epilog always exits 0: Slurm drains a node whose Epilog fails ("Epilog error").
set -u
# slurmd gives no PATH: set one before anything else runs, never the caller's (a
# PATH another user set would choose what root runs); the site's defaults file may
# set another (gpudiag-common.sh).
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# shellcheck source-path=SCRIPTDIR source=gpudiag-common.sh
. "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/gpudiag-common.sh"

# Not a GPU job: nothing to explain.
[[ -n ${SLURM_JOB_GPUS:-} ]] || exit 0
job=${SLURM_JOB_ID:-0}
node=$(gpudiag_node_name)

# Only a record the job's owner (or root) wrote counts: another user's record for this job
# id, naming a window and GPUs of their choosing, is ignored (the kernel recorded its owner).
owner=()
[[ ${SLURM_JOB_UID:-} =~ ^[0-9]+$ ]] && owner=(--job-uid "$SLURM_JOB_UID")
answer=$(timeout --kill-after=5 "$GPUDIAG_TIMEOUT_S" \
    "$GPUDIAG" explain --slurm-job "$job" "${owner[@]}" --format kv 2>&1)
rc=$?
if [[ $rc -ne 0 ]]; then
    # 1: no `gpudiag run` of this job reported (a job that did not use it); else a failure.
    [[ $rc -eq 1 ]] || gpudiag_log "job $job on $node: gpudiag explain exit $rc: ${answer:0:500}"
    exit 0
fi
value() {
    sed -n "s/^$1=//p" <<<"$answer" | head -n 1
}
kind=$(value attribution)
code=$(value code)
line=$(value gpu_failure_attribution)

case $kind in
    hardware | software | unknown)
        if [[ -n ${GPUDIAG_RECORD_DIR:-} ]]; then
            "$GPUDIAG" explain --slurm-job "$job" "${owner[@]}" --format json \
                >"$GPUDIAG_RECORD_DIR/job-$job-explain.json" 2>/dev/null \
                || gpudiag_log "job $job: could not write $GPUDIAG_RECORD_DIR/job-$job-explain.json"
        fi
        gpudiag_log "job $job on $node: GPU failure attribution $line"
        ;;
esac
if [[ $kind == hardware ]]; then
    # Only a window the kernel attests: the daemon saw the run begin and end on its socket
    # (attested=socket), or root wrote the record (attested=root). A record anyone could
    # write (attested=no) names a window, GPUs and a job id of its writer's choosing.
    case $(value attested) in
        socket | root) gpudiag_drain "$node" "${code:-gpu_fault} during job $job" ;;
        *) gpudiag_log "job $job on $node: not drained: the hardware attribution comes only from a record of uid $(value owner_uid) that nothing attests" ;;
    esac
fi
exit 0
