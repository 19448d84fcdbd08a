# shellcheck shell=bash
# Shared by gpudiag-prolog.sh and gpudiag-healthcheck.sh: configuration, the bounded
# preflight call and the drain bookkeeping. Sourced, never run.
#
# Slurm starts Prologs and the HealthCheckProgram with an almost empty environment (no PATH,
# no SLURM_CONF), so everything has a default here and site settings come from a KEY=VALUE
# file, /etc/default/gpudiag unless GPUDIAG_DEFAULTS names another one.

# PATH is set by the scripts before they source this file (a fixed one: never the caller's).
#
# What runs as root comes only from the site's config, never from the environment (anyone
# who can set a variable for a Prolog, a health check or `sudo`-run copy would choose the
# binary root runs): GPUDIAG, SCONTROL and GPUDIAG_DAEMON_URL from the environment are
# dropped, and the defaults file is sourced only when it is a regular file owned by root
# (or by the user running this), writable by nobody else, in folders nobody else may write
# (a sticky /tmp-like folder owned by root is fine). GPUDIAG_DEFAULTS may name another file
# that passes the same test; one that does not is skipped with a log line.
unset GPUDIAG SCONTROL SCANCEL GPUDIAG_DAEMON_URL

# gpudiag_trusted_file PATH: the test above, for one file and every folder above it.
gpudiag_trusted_file() {
    local path=$1 uid mode me
    me=$(id -u)
    [[ $path == /* && -f $path && ! -L $path ]] || return 1
    read -r uid mode < <(stat -c '%u %a' -- "$path") || return 1
    [[ $uid == 0 || $uid == "$me" ]] || return 1
    (( (8#$mode & 8#022) == 0 )) || return 1
    path=$(dirname -- "$path")
    while :; do
        [[ ! -L $path ]] || return 1
        read -r uid mode < <(stat -c '%u %a' -- "$path") || return 1
        [[ $uid == 0 || $uid == "$me" ]] || return 1
        # Others may write it only when it is sticky (they cannot replace root's files).
        (( (8#$mode & 8#022) == 0 || (8#$mode & 8#1000) != 0 )) || return 1
        [[ $path != / ]] || return 0
        path=$(dirname -- "$path")
    done
}

gpudiag_defaults=${GPUDIAG_DEFAULTS:-/etc/default/gpudiag}
if [[ $gpudiag_defaults != /dev/null && -e $gpudiag_defaults ]]; then
    if gpudiag_trusted_file "$gpudiag_defaults"; then
        # Every assignment there is exported (set -a): gpudiag itself may need some
        # (LD_LIBRARY_PATH, SLURM_CONF for scontrol, CUDA_* for the probes).
        set -a
        # shellcheck disable=SC1090
        . "$gpudiag_defaults"
        set +a
    else
        logger -t gpudiag-slurm -- "not sourcing $gpudiag_defaults: not a root-owned file closed to others" 2>/dev/null || true
        echo "gpudiag-slurm: not sourcing $gpudiag_defaults: not a root-owned file closed to others (nor in such folders)" >&2
    fi
fi

GPUDIAG=${GPUDIAG:-/opt/gpudiag/bin/gpudiag}
SCONTROL=${SCONTROL:-scontrol}
SCANCEL=${SCANCEL:-scancel}
# preflight asks the local daemon first (milliseconds, cached) and falls back to running
# the probes itself when the daemon does not answer. On its unix socket: an answer there is
# trusted only from the daemon's user (SO_PEERCRED), where any local user could answer on
# 127.0.0.1:9477 while the daemon is down (docs/security.md).
export GPUDIAG_DAEMON_URL=${GPUDIAG_DAEMON_URL:-unix:/run/gpudiag/daemon/gpudiag.sock}
# Slurm kills a Prolog or health check after 60 s: stay well inside that.
GPUDIAG_TIMEOUT_S=${GPUDIAG_TIMEOUT_S:-40}
GPUDIAG_PROBE_TIMEOUT_S=${GPUDIAG_PROBE_TIMEOUT_S:-20}
# Drains this tooling makes carry this prefix; only those are ever undrained by it.
GPUDIAG_REASON_PREFIX="gpudiag:"

gpudiag_log() {
    # syslog when there is one (slurmd's own log does not keep a Prolog's stderr).
    logger -t gpudiag-slurm -- "$*" 2>/dev/null || true
    echo "gpudiag-slurm: $*" >&2
}

# gpudiag_installed WHAT: true when $GPUDIAG can run; else says so loudly (syslog and
# stderr) and is false: a broken install must neither read as a healthy node nor drain one.
gpudiag_installed() {
    [[ -f $GPUDIAG && -x $GPUDIAG ]] && return 0
    gpudiag_log "$1 not run: no gpudiag at $GPUDIAG (install it there, or set GPUDIAG= in $gpudiag_defaults); node left as is"
    return 1
}

# gpudiag_ask COMMAND ARGS...: run `gpudiag COMMAND --format kv ARGS` (COMMAND is preflight,
# the job-readiness question, or health, the node-health question), bounded in time.
# Sets PREFLIGHT_RC (0 ready, 1 blocked, 2 usage, 3 failure, 124 timed out),
# PREFLIGHT_CODE (gpu_validation_blocker, or "unknown") and PREFLIGHT_KV (the record).
gpudiag_ask() {
    local errfile command=$1
    shift
    errfile=$(mktemp) || errfile=/dev/null
    PREFLIGHT_KV=$(timeout --kill-after=5 "$GPUDIAG_TIMEOUT_S" \
        "$GPUDIAG" "$command" --format kv --timeout "$GPUDIAG_PROBE_TIMEOUT_S" "$@" 2>"$errfile")
    PREFLIGHT_RC=$?
    # shellcheck disable=SC2034  # read by the sourcing script
    PREFLIGHT_ERR=$(tail -c 2000 "$errfile" 2>/dev/null | tr '\n' ' ')
    [[ $errfile == /dev/null ]] || rm -f "$errfile"
    PREFLIGHT_CODE=$(sed -n 's/^gpu_validation_blocker=//p' <<<"$PREFLIGHT_KV" | head -n 1)
    if [[ -z $PREFLIGHT_CODE ]]; then
        PREFLIGHT_CODE=unknown
        # "Blocked" without a record is not a verdict: treat it as gpudiag failing.
        [[ $PREFLIGHT_RC -ne 1 ]] || PREFLIGHT_RC=3
    fi
}

# Codes that say "not proven now" or "in use", never "broken": busy never drains a node, and
# neither does a backend gpudiag could not prove because jobs hold every GPU
# (docs/design-notes.md, "Proven or not ready").
GPUDIAG_NOT_BROKEN_CODES=${GPUDIAG_NOT_BROKEN_CODES:-"backend_unproven devices_busy lock_timeout"}

# gpudiag_not_broken CODE: true when CODE is one of GPUDIAG_NOT_BROKEN_CODES.
gpudiag_not_broken() {
    [[ " $GPUDIAG_NOT_BROKEN_CODES " == *" $1 "* ]]
}

# Only the node's own faults drain it: the layers below the job's software (a probe child
# that hung in the driver, device nodes, the driver, the GPU, CUDA's init). A code of a
# job environment's backend (jax_*, iree_*, a probe child of JAX or IREE), of the
# requirement or of admission is software, a job's or a runtime's: it may refuse a job,
# it never drains a node (docs/operations.md, "Slurm").
GPUDIAG_DRAIN_LAYERS=${GPUDIAG_DRAIN_LAYERS:-"probe visibility driver device cuda"}

# gpudiag_drains CODE: true when CODE, in the last record, is one of the node's own faults.
gpudiag_drains() {
    local code=$1 i layer backend
    gpudiag_not_broken "$code" && return 1
    [[ $code =~ ^[a-z0-9_]+$ ]] || return 1
    i=$(sed -n "s/^blockers\.\([0-9]*\)\.code=$code\$/\1/p" <<<"$PREFLIGHT_KV" | head -n 1)
    [[ -n $i ]] || return 1
    layer=$(gpudiag_kv "blockers\.$i\.layer")
    backend=$(gpudiag_kv "blockers\.$i\.backend")
    [[ " $GPUDIAG_DRAIN_LAYERS " == *" $layer "* ]] || return 1
    [[ $layer != probe || ($backend != jax && $backend != iree) ]]
}

# gpudiag_split_require REQUIRE: the node's own part of a requirement (GPUDIAG_DEVICE_REQUIRE,
# cuda when nothing else is named) and the backends proven in a job's environment
# (GPUDIAG_SOFTWARE_REQUIRE: jax, iree). A Prolog or a health check runs before and outside
# any job's environment: its jax and iree mean the node's configured runtimes
# ([runtimes.NAME] of the daemon), never the Python on the script's PATH.
gpudiag_split_require() {
    local item name
    local -a items device=() software=()
    IFS=',' read -ra items <<<"$1"
    for item in "${items[@]}"; do
        item=${item//[[:space:]]/}
        name=${item%%:*}
        case ${name,,} in
            jax | iree) [[ " ${software[*]} " == *" ${name,,} "* ]] || software+=("${name,,}") ;;
            *) device+=("$item") ;;
        esac
    done
    GPUDIAG_DEVICE_REQUIRE=$(IFS=,; echo "${device[*]}")
    GPUDIAG_DEVICE_REQUIRE=${GPUDIAG_DEVICE_REQUIRE:-cuda}
    # shellcheck disable=SC2034  # read by the sourcing script
    GPUDIAG_SOFTWARE_REQUIRE=${software[*]}
}

# gpudiag_runtimes_answer BACKEND...: answer jax/iree from the node's configured runtimes, as
# the daemon's node-health answer in PREFLIGHT_KV lists them (runtimes.NAME.*). A backend is
# served when one runtime that promises it proved it; failing when every runtime that
# promises it is blocked or refused; not checked when none promises it (or no daemon
# answered: only the daemon knows the runtimes). Sets RUNTIMES_RC (1: one failing),
# RUNTIMES_CODE (the first failing runtime's code) and RUNTIMES_SAID (" jax=ok" ...).
gpudiag_runtimes_answer() {
    local backend name state status serving ok failing
    # shellcheck disable=SC2034  # RUNTIMES_RC and RUNTIMES_CODE are read by the sourcing script
    RUNTIMES_RC=0 RUNTIMES_CODE="" RUNTIMES_SAID=""
    for backend in "$@"; do
        serving=0 ok=0 failing=""
        for name in $(gpudiag_kv runtimes | tr ',' ' '); do
            [[ $name =~ ^[a-z0-9][a-z0-9_.-]*$ ]] || continue
            [[ ",$(gpudiag_kv "runtimes\.$name\.serves")," == *",$backend,"* ]] || continue
            serving=1
            state=$(gpudiag_kv "runtimes\.$name\.state")
            status=$(gpudiag_kv "runtimes\.$name\.backends\.$backend")
            if [[ $status == ok ]]; then
                ok=1
            elif [[ $state == refused ]]; then
                failing=${failing:-"$name:runtime_refused"}
            elif [[ $state == blocked ]]; then
                failing=${failing:-"$name:$(gpudiag_kv "runtimes\.$name\.blocker")"}
            fi
        done
        if ((serving == 0)); then
            RUNTIMES_SAID+=" $backend=not_checked"
        elif ((ok == 1)); then
            RUNTIMES_SAID+=" $backend=ok"
        elif [[ -n $failing ]]; then
            RUNTIMES_SAID+=" $backend=runtime:$failing"
            # shellcheck disable=SC2034  # read by the sourcing script
            RUNTIMES_RC=1
            RUNTIMES_CODE=${RUNTIMES_CODE:-${failing#*:}}
        else
            RUNTIMES_SAID+=" $backend=unproven"
        fi
    done
}

# gpudiag_ask_runtimes BACKEND...: ask the daemon for the node's health (its runtime
# section), then gpudiag_runtimes_answer; the last record (PREFLIGHT_*) is kept as it was.
gpudiag_ask_runtimes() {
    local kv=$PREFLIGHT_KV rc=$PREFLIGHT_RC code=$PREFLIGHT_CODE err=$PREFLIGHT_ERR
    gpudiag_ask health --require cuda
    [[ $PREFLIGHT_RC == 0 || $PREFLIGHT_RC == 1 ]] || PREFLIGHT_KV=""
    gpudiag_runtimes_answer "$@"
    PREFLIGHT_KV=$kv PREFLIGHT_RC=$rc PREFLIGHT_CODE=$code PREFLIGHT_ERR=$err
}

# gpudiag_preflight ARGS...: job readiness (gpudiag_ask preflight ARGS).
gpudiag_preflight() {
    gpudiag_ask preflight "$@"
}

# gpudiag_kv KEY: one value of the last preflight record.
gpudiag_kv() {
    sed -n "s/^$1=//p" <<<"$PREFLIGHT_KV" | head -n 1
}

# gpudiag_node_reason NODE: the node's drain/down reason ("" when none), without the
# "[user@time]" stamp scontrol adds.
gpudiag_node_reason() {
    local out
    out=$("$SCONTROL" show node "$1" 2>/dev/null) || return 1
    sed -n 's/^[[:space:]]*Reason=\(.*\)$/\1/p' <<<"$out" | head -n 1 | sed 's/ *\[[^]]*\]$//'
}

# gpudiag_node_state NODE: the State= word, e.g. IDLE+DRAIN.
gpudiag_node_state() {
    "$SCONTROL" show node "$1" 2>/dev/null | sed -n 's/.*[[:space:]]State=\([^[:space:]]*\).*/\1/p' | head -n 1
}

gpudiag_is_own_reason() {
    [[ $1 == "$GPUDIAG_REASON_PREFIX"* ]]
}

# gpudiag_is_daemon_reason REASON: a drain the daemon's remediation made
# ("gpudiag:node:CODE:GPU-...", no space after the colon): the daemon's to resume, after
# `gpudiag clear` and a fresh pass; these scripts neither rewrite nor resume it.
gpudiag_is_daemon_reason() {
    [[ $1 == "$GPUDIAG_REASON_PREFIX"[a-z]* ]]
}

# gpudiag_drain NODE CODE: drain with "gpudiag: CODE" unless someone else drained it first
# (their reason is kept: it is theirs to clear).
gpudiag_drain() {
    local node=$1 code=$2 reason
    reason=$(gpudiag_node_reason "$node") || reason=""
    if [[ -n $reason ]] && ! gpudiag_is_own_reason "$reason"; then
        gpudiag_log "node $node blocked ($code) but already drained for '$reason': left alone"
        return 0
    fi
    if [[ $reason == "$GPUDIAG_REASON_PREFIX $code" ]] || gpudiag_is_daemon_reason "$reason"; then
        return 0
    fi
    gpudiag_log "draining $node: $GPUDIAG_REASON_PREFIX $code"
    "$SCONTROL" update NodeName="$node" State=DRAIN Reason="$GPUDIAG_REASON_PREFIX $code"
}

# gpudiag_undrain NODE: resume the node only when the drain is gpudiag's own.
gpudiag_undrain() {
    local node=$1 reason state
    reason=$(gpudiag_node_reason "$node") || return 0
    gpudiag_is_own_reason "$reason" || return 0
    gpudiag_is_daemon_reason "$reason" && return 0
    state=$(gpudiag_node_state "$node")
    [[ $state == *DRAIN* || $state == *DOWN* || $state == *FAIL* ]] || return 0
    gpudiag_log "resuming $node: gpudiag reports ready (was '$reason')"
    "$SCONTROL" update NodeName="$node" State=RESUME
}

gpudiag_node_name() {
    echo "${SLURMD_NODENAME:-$(hostname -s)}"
}
