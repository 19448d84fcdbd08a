#!/usr/bin/env bash
# Validate gpudiag on a real NVIDIA GPU, with no network, in a few minutes a section (every
# section at once may take more than one 10-minute device call: pick with GPUDIAG_VALIDATE_ONLY).
#
#   scripts/gpu-validate.sh OUTDIR
#
# Writes to OUTDIR: probe/preflight records, daemon samples and the GPU memory the daemon's
# own process holds (must be none), the JAX probe's peak GPU memory against the card's total,
# cold timings (bare framework init against the gpudiag probe), safe faults, a `gpudiag run
# --require jax` closeout, the carried IREE module; the daemon's /metrics checked by
# `promtool check metrics` and the recording rules evaluated on it (`promtool test rules`);
# occupancy on the real card (a helper holds a context and memory on GPU 0: the daemon and
# inline preflight must say busy and make no context there, node health stays healthy, and
# once the helper stops the GPU turns free and proven); the safe faults' real texts next to
# the fakes' (texts/comparison.txt); round 5: the job watch's two runs on the card (one that
# spins on a flag, one that computes) with their utilization and power once a second, the
# fabric as sysfs shows it, the GPU inventory before and after every qualification tier (it
# must be unchanged), the SDC tier's wall time and coverage. checks.tsv has one line per check (NAME, pass|fail|
# blocked, detail), summary.txt the same in words, and OUTDIR/gpu-validate-*.tgz all of it.
# Safe on a shared card: it never changes the card's settings and never resets it.
# On a GPU-less host it still runs and every check is a blocker record (never a pass).
#
# Knobs (environment): GPUDIAG_VALIDATE_ONLY=probe,jaxmem,timings,faults,daemon,run,iree,
# occupancy,together,nvml,qualify,sdc,attribution,image,runtimes,jobpython,jobwatch,fabric,
# inventory,identity,texts (default all); GPUDIAG_VALIDATE_DAEMON_S (daemon sampling, default 40);
# GPUDIAG_VALIDATE_JOBWATCH_S (how long each job watch run lasts, default 45; the daemon's
# [jobs] stall_after_s is a third of it); GPUDIAG_VALIDATE_SPINNER, GPUDIAG_VALIDATE_COMPUTER
# (the job watch's two jobs; default `scripts/gpu_validate.py spin|compute --seconds S`);
# GPUDIAG_VALIDATE_PORT (default 19477, and the next port); GPUDIAG_VALIDATE_FAKES (a built
# tests/fakes tree for the texts' fake side; default: built here when gcc is present);
# GPUDIAG_VALIDATE_HOLDER (a command that holds GPU 0 and prints a "holding" line; default
# `scripts/gpu_validate.py hold`).
set -uo pipefail

OUT=${1:?usage: scripts/gpu-validate.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-}
if [[ -z $PY ]]; then
    if [[ -x $REPO/.venv/bin/python ]]; then PY=$REPO/.venv/bin/python; else PY=$(command -v python3); fi
fi
# Run from the working tree without installing (the device machine has no network).
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
unset XLA_PYTHON_CLIENT_PREALLOCATE XLA_PYTHON_CLIENT_ALLOCATOR \
    XLA_PYTHON_CLIENT_USE_CUDA_HOST_ALLOCATOR JAX_PLATFORMS CUDA_VISIBLE_DEVICES
SUMMARY=$OUT/summary.txt
CHECKS=$OUT/checks.tsv
: >"$SUMMARY"
: >"$CHECKS"
GV=("$PY" "$REPO/scripts/gpu_validate.py")
ONLY=${GPUDIAG_VALIDATE_ONLY:-all}
DAEMON_S=${GPUDIAG_VALIDATE_DAEMON_S:-40}
PORT=${GPUDIAG_VALIDATE_PORT:-19477}
START_S=$SECONDS
note() { printf '%s\n' "$*" | tee -a "$SUMMARY"; }
field() { "${GV[@]}" get "$1" "$2" 2>/dev/null; }
blocker_of() { field "$1" gpu_validation_blocker; }
want() { [[ $ONLY == all || ,$ONLY, == *",$1,"* ]]; }
section() { note "## $1 (at $((SECONDS - START_S)) s)"; }
has_gpu=0
nvidia-smi -L >/dev/null 2>&1 && has_gpu=1
# result NAME pass|fail|blocked DETAIL: one check. Without a GPU nothing can pass (nor fail
# on a GPU's account): every check becomes a blocker record that keeps what it would be.
result() {
    local name=$1 status=$2
    shift 2
    local detail="$*"
    if [[ $has_gpu -eq 0 && $status != blocked ]]; then
        detail="no GPU (nvidia-smi -L failed); would be $status: $detail"
        status=blocked
    fi
    printf '%s\t%s\t%s\n' "$name" "$status" "${detail//$'\t'/ }" >>"$CHECKS"
    note "check $name: $status - $detail"
}
# pass_if NAME CONDITION-STATUS DETAIL: pass when the status is 0, else fail.
pass_if() {
    local name=$1 ok=$2
    shift 2
    if [[ $ok -eq 0 ]]; then result "$name" pass "$@"; else result "$name" fail "$@"; fi
}
first_uuid=$(nvidia-smi --query-gpu=uuid --format=csv,noheader 2>/dev/null | head -1)
# Stopped early (timeout, ^C): leave nothing behind, above all not the helper on the card.
# Each PID is unset once reaped, so that a reused PID is never signalled.
cleanup() {
    local p
    for p in ${helper_pid:-} ${watch_pid:-} ${daemon_pid:-} ${jax_pid:-} ${smi_pid:-} ${job_pid:-}; do
        kill "$p" 2>/dev/null
    done
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

note "# gpudiag GPU validation, $(date -u +%Y-%m-%dT%H:%M:%SZ), host $(hostname)"
{
    echo "python: $("$PY" --version 2>&1) ($PY)"
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    nvidia-smi -L 2>&1 || true
    "$PY" -m pip list 2>/dev/null | grep -iE '^(jax|jaxlib|jax-cuda|nvidia-ml-py|iree|click|prometheus|rich) ' || true
} >"$OUT/environment.txt" 2>&1
note "gpu present (nvidia-smi -L): $has_gpu"

# The inventory (round 5): the GPU's settings and firmware (VBIOS, InfoROM, GSP, power
# limits, application and max clocks, persistence, ECC, compute and MIG mode) from
# `nvidia-smi -q` and the nvml probe, read before and after every qualification tier this run
# starts: a diagnostic leaves the GPU as it found it. inv_snap TAG; inv_same NAME BEFORE AFTER.
inv_snap() {
    want inventory || return 0
    local d=$OUT/inventory
    mkdir -p "$d"
    nvidia-smi -q >"$d/$1.smi-q.txt" 2>&1
    timeout 60 "$PY" -m gpudiag probe --backend nvml --format json >"$d/$1.nvml.json" 2>>"$d/errors.txt"
    "${GV[@]}" inventory "$d/$1.smi-q.txt" "$d/$1.nvml.json" >"$d/$1.json" 2>>"$d/errors.txt"
}
inv_same() {
    want inventory || return 0
    local said rc
    said=$("${GV[@]}" inventory-diff "$OUT/inventory/$2.json" "$OUT/inventory/$3.json" 2>&1)
    rc=$?
    pass_if "$1" "$rc" "$2 -> $3: $said"
}
inv_snap start


# 1. Probe every backend; preflight cuda,jax as JSON and kv (inline: no daemon is asked).
if want probe; then
    section "probe and preflight"
    timeout 120 "$PY" -m gpudiag probe --json >"$OUT/probe.json" 2>"$OUT/probe.stderr"
    rc=$? got=$(blocker_of "$OUT/probe.json")
    ok=1; [[ $rc -eq 0 && $got == none ]] && ok=0
    pass_if probe "$ok" "gpudiag probe (all backends): exit $rc blocker=$got"
    timeout 120 "$PY" -m gpudiag preflight --no-daemon --require cuda,jax --format json \
        >"$OUT/preflight-cuda-jax.json" 2>>"$OUT/probe.stderr"
    rc=$? got=$(blocker_of "$OUT/preflight-cuda-jax.json")
    prealloc=$(field "$OUT/preflight-cuda-jax.json" preallocation_disabled)
    ok=1; [[ $rc -eq 0 && $got == none && $prealloc == yes ]] && ok=0
    pass_if preflight-cuda-jax "$ok" "exit $rc blocker=$got preallocation_disabled=$prealloc"
    timeout 120 "$PY" -m gpudiag preflight --no-daemon --require cuda,jax --format kv \
        >"$OUT/preflight-cuda-jax.kv" 2>>"$OUT/probe.stderr"
    rc=$?
    ok=1; grep -q "^gpu_validation_blocker=none$" "$OUT/preflight-cuda-jax.kv" && ok=0
    pass_if preflight-cuda-jax-kv "$ok" "exit $rc $(grep '^gpu_validation_blocker=' "$OUT/preflight-cuda-jax.kv")"
fi

# 2. The peak GPU memory of the JAX probe with preallocation disabled, against the total.
total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
if want jaxmem; then
    section "JAX probe peak memory"
    "$PY" -m gpudiag.probes jax '{"platform": "gpu"}' >"$OUT/jax-probe.json" 2>"$OUT/jax-probe.stderr" &
    jax_pid=$!
    peak=0
    while kill -0 "$jax_pid" 2>/dev/null; do
        used=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null \
            | awk -F', *' -v p="$jax_pid" '$1 == p {print $2}')
        [[ -n $used && $used -gt $peak ]] && peak=$used
        sleep 0.05
    done
    wait "$jax_pid"
    unset jax_pid
    # Preallocation would take 75% of the card; disabled, the probe needs a context and a
    # few MiB. Under a quarter of the card is the claim; 0 means nvidia-smi never saw it.
    ok=1; [[ $peak -gt 0 && -n $total_mib && $((peak * 4)) -lt $total_mib ]] && ok=0
    pass_if jax-probe-peak-memory "$ok" "${peak} MiB of ${total_mib:-?} MiB (preallocation disabled)"
fi

# 3. Cold timings: the bare framework init against the gpudiag probe (median of 3 each).
if want timings; then
    section "cold timings"
    "$PY" - "$OUT/timings.txt" <<'PYEOF' 2>>"$OUT/timings.stderr"
import json, statistics, subprocess, sys, time
cases = {
    "nvml": ("import pynvml; pynvml.nvmlInit(); pynvml.nvmlDeviceGetCount()", "nvml"),
    "cuda": ("import ctypes; l=ctypes.CDLL('libcuda.so.1'); assert l.cuInit(0)==0", "cuda"),
    "jax": ("import jax; jax.devices()", "jax"),
}
lines = []
for name, (bare, backend) in cases.items():
    def med(argv):
        ts = []
        for _ in range(3):
            t = time.perf_counter(); subprocess.run(argv, capture_output=True, timeout=120); ts.append(time.perf_counter() - t)
        return statistics.median(ts)
    b = med([sys.executable, "-c", bare])
    g = med([sys.executable, "-m", "gpudiag", "probe", "--backend", backend, "--json"])
    lines.append(f"{name}: bare {b*1000:.0f} ms, gpudiag probe {g*1000:.0f} ms, ratio {g/b:.2f}")
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
    sed 's/^/timing: /' "$OUT/timings.txt" >>"$SUMMARY" 2>/dev/null
fi

# 4. Faults that are safe on a shared card: gpudiag's verdict for each.
fault() {  # fault NAME EXPECTED -- ENV... -- ARGS...
    local name=$1 expected=$2
    shift 2
    local envs=() args=()
    [[ $1 == -- ]] && shift
    while [[ $# -gt 0 && $1 != -- ]]; do envs+=("$1"); shift; done
    [[ ${1:-} == -- ]] && shift
    args=("$@")
    env ${envs[@]+"${envs[@]}"} timeout 120 "$PY" -m gpudiag preflight --no-daemon "${args[@]}" \
        --format json >"$OUT/fault-$name.json" 2>"$OUT/fault-$name.stderr"
    local rc=$? got
    got=$(blocker_of "$OUT/fault-$name.json")
    ok=1; [[ $got == "$expected" ]] && ok=0
    pass_if "fault-$name" "$ok" "exit $rc blocker=$got expected=$expected"
}
if want faults; then
    section "safe faults"
    fault cvd-empty visible_devices_empty -- CUDA_VISIBLE_DEVICES= -- --require cuda
    fault cvd-invalid visible_devices_invalid -- CUDA_VISIBLE_DEVICES=7 -- --require cuda
    if [[ -n $first_uuid ]]; then
        fault cvd-uuid none -- "CUDA_VISIBLE_DEVICES=$first_uuid" -- --require cuda
    fi
    fault cvd-bogus-uuid visible_devices_invalid \
        -- CUDA_VISIBLE_DEVICES=GPU-00000000-0000-0000-0000-000000000000 -- --require cuda
    fault jax-platforms-cpu jax_cpu_fallback -- JAX_PLATFORMS=cpu -- --require cuda,jax
    fault leaked-prealloc jax_preallocation_enabled -- XLA_PYTHON_CLIENT_PREALLOCATE=true -- --require cuda,jax
    fault jax-deadline probe_timeout -- -- --require jax --timeout 0.3
fi

# daemon_start NAME PORT CONFIG [ENV...]: a daemon in the background (daemon_pid, daemon_url);
# daemon_args: more `gpudiag serve` arguments (--socket PATH), none unless set.
daemon_args=()
daemon_start() {
    local name=$1 port=$2 config=$3
    shift 3
    daemon_state=$(mktemp -d)
    env "$@" "$PY" -m gpudiag serve --listen "127.0.0.1:$port" --config "$config" \
        --state-dir "$daemon_state" --log-format json ${daemon_args[@]+"${daemon_args[@]}"} \
        >"$OUT/$name.stdout" 2>"$OUT/$name.log" &
    daemon_pid=$!
    daemon_url=http://127.0.0.1:$port
    local i
    for ((i = 0; i < 100; i++)); do  # /readyz: the first full round is done
        curl -sf -o /dev/null "$daemon_url/readyz" && return 0
        kill -0 "$daemon_pid" 2>/dev/null || return 1
        sleep 0.5
    done
    return 1
}
daemon_stop() {
    kill "$daemon_pid" 2>/dev/null
    wait "$daemon_pid" 2>/dev/null
    unset daemon_pid
    rm -rf "$daemon_state"
}

# 5. The daemon: /metrics and /v1/preflight samples, the GPU memory of its own process, and
# the /metrics text checked by promtool with the recording rules evaluated on it.
if want daemon; then
    section "daemon for $DAEMON_S s"
    printf '[backends.jax]\ninterval_s = 30\n' >"$OUT/daemon.toml"
    ready=NO
    daemon_start daemon "$PORT" "$OUT/daemon.toml" GPUDIAG_VALIDATE=1 && ready=yes
    note "daemon ready (/readyz) after $((SECONDS - START_S)) s: $ready"
    samples=$(( DAEMON_S / 10 > 0 ? DAEMON_S / 10 : 1 ))
    : >"$OUT/daemon-samples.txt"
    for ((i = 1; i <= samples; i++)); do
        sleep 10
        curl -s -o "$OUT/metrics-$i.txt" -w '%{http_code} %{time_total}\n' \
            "$daemon_url/metrics" >>"$OUT/daemon-samples.txt" 2>&1
        curl -s -o "$OUT/daemon-preflight-$i.json" -w '%{http_code} %{time_total}\n' \
            "$daemon_url/v1/preflight?require=cuda" >>"$OUT/daemon-samples.txt" 2>&1
    done
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv >"$OUT/daemon-compute-apps.csv" 2>&1
    ok=1; ! grep -qE "^$daemon_pid," "$OUT/daemon-compute-apps.csv" && ok=0
    pass_if daemon-gpu-memory "$ok" "daemon pid $daemon_pid in nvidia-smi's compute apps: $(grep -cE "^$daemon_pid," "$OUT/daemon-compute-apps.csv")"
    ok=1; ! grep -qv '^200 ' "$OUT/daemon-samples.txt" && [[ -s $OUT/daemon-samples.txt ]] && ok=0
    pass_if daemon-samples "$ok" "http code, seconds: $(tr '\n' ';' <"$OUT/daemon-samples.txt")"
    got=$(blocker_of "$OUT/daemon-preflight-$samples.json")
    ok=1; [[ $got == none ]] && ok=0
    pass_if daemon-preflight "$ok" "last /v1/preflight?require=cuda blocker=$got"
    cp "$OUT/metrics-$samples.txt" "$OUT/metrics.txt" 2>/dev/null
    daemon_stop
    if ! command -v promtool >/dev/null; then
        result promtool-check-metrics blocked "promtool not installed"
    elif [[ ! -s $OUT/metrics.txt ]]; then
        result promtool-check-metrics fail "no /metrics text was scraped"
    else
        promtool check metrics <"$OUT/metrics.txt" >"$OUT/promtool-check-metrics.txt" 2>&1
        rc=$?
        pass_if promtool-check-metrics $rc "exit $rc: $(head -c 300 "$OUT/promtool-check-metrics.txt" | tr '\n' ' ')"
        "${GV[@]}" rules-test "$OUT/metrics.txt" "$REPO/prometheus/gpudiag.rules.yml" \
            "$OUT/rules-on-scrape.test.json" >"$OUT/promtool-test-rules.txt" 2>&1 \
            && promtool test rules "$OUT/rules-on-scrape.test.json" >>"$OUT/promtool-test-rules.txt" 2>&1
        rc=$?
        pass_if promtool-test-rules $rc "recording rules on the scraped samples: exit $rc: $(tail -c 300 "$OUT/promtool-test-rules.txt" | tr '\n' ' ')"
    fi
fi

# 6. gpudiag run --require jax of a small JAX program, with its closeout.
if want run; then
    section "gpudiag run --require jax"
    cat >"$OUT/small_jax.py" <<'PYEOF'
import jax, jax.numpy as jnp
x = jnp.arange(1024.0)
print("backend", jax.default_backend(), "devices", jax.devices(), "sum", float((x * 2).sum()))
PYEOF
    timeout 120 "$PY" -m gpudiag run --require jax --artifacts "$OUT/run" -- "$PY" "$OUT/small_jax.py" \
        >"$OUT/run.stdout" 2>"$OUT/run.stderr"
    rc=$?
    closeout=$(find "$OUT/run" -name closeout.txt 2>/dev/null | head -1)
    ok=1; [[ $rc -eq 0 ]] && grep -q '^gpu_validation_blocker=none$' "$closeout" 2>/dev/null && ok=0
    pass_if run-jax "$ok" "exit $rc; closeout: $(grep -E '^(gpu_validation_blocker|preallocation_disabled|gpu_execution_route)=' "$closeout" 2>/dev/null | tr '\n' ' ')"
fi

# 7. IREE: the carried module compiled elsewhere for a CUDA target the compiler supports.
if want iree; then
    section "IREE module"
    for vmfb in "$REPO"/validation-assets/*.vmfb; do
        [[ -f $vmfb ]] || continue
        timeout 120 "$PY" - "$vmfb" >>"$OUT/iree-module.txt" 2>&1 <<'PYEOF'
import sys
try:
    import numpy as np
    import iree.runtime as rt
except Exception as e:
    print("iree runtime not importable:", e); sys.exit(0)
path = sys.argv[1]
try:
    config = rt.Config("cuda")
    with open(path, "rb") as f:
        vm = rt.VmModule.copy_buffer(config.vm_instance, f.read())
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(vm)
    fn = ctx.modules.module["add"]
    a = np.arange(8, dtype=np.float32)
    print(path, "result", np.asarray(fn(a, a)).tolist())
except Exception as e:
    print(path, "failed:", type(e).__name__, e)
PYEOF
    done
    ok=1; grep -q ' result \[0.0, 2.0, 4.0' "$OUT/iree-module.txt" 2>/dev/null && ok=0
    pass_if iree-module "$ok" "$(tr '\n' ' ' <"$OUT/iree-module.txt" 2>/dev/null | head -c 400)"
fi

# 8. Occupancy on the real card, without changing its settings: a helper (someone else's job,
# as far as gpudiag can tell) holds a context and 1 GiB on GPU 0. The daemon and inline
# preflight must call it busy and make no context of their own there; `--gpus 1` is
# devices_busy; node health stays healthy (busy is healthy in use, docs/design-notes.md
# "Busy GPUs"). Then the helper stops and the GPU must turn free and proven.
if want occupancy; then
    section "occupancy"
    occ=$OUT/occupancy
    mkdir -p "$occ"
    occ_env=()  # on a host with more GPUs, gpudiag looks at GPU 0 only (a one-GPU host)
    [[ -n $first_uuid ]] && occ_env=("CUDA_VISIBLE_DEVICES=$first_uuid")
    if [[ -n ${GPUDIAG_VALIDATE_HOLDER:-} ]]; then
        read -ra holder <<<"$GPUDIAG_VALIDATE_HOLDER"
    else
        holder=("${GV[@]}" hold --mib 1024 --max-s 240)
    fi
    # The daemon first, on the free GPU: its first full round (cuda, JAX and IREE) proves it.
    printf '[backends.nvml]\ninterval_s = 1\n[backends.cuda]\ninterval_s = 2\n[backends.jax]\ninterval_s = 5\n[backends.iree]\ninterval_s = 5\n' \
        >"$occ/daemon.toml"
    ready=NO
    daemon_start occupancy/daemon $((PORT + 1)) "$occ/daemon.toml" GPUDIAG_VALIDATE=1 \
        ${occ_env[@]+"${occ_env[@]}"} && ready=yes
    note "occupancy daemon ready (/readyz, GPU free) after $((SECONDS - START_S)) s: $ready"
    nvidia-smi --query-compute-apps=pid --format=csv,noheader >"$occ/apps-baseline.txt" 2>&1
    env ${occ_env[@]+"${occ_env[@]}"} "${holder[@]}" >"$occ/helper.out" 2>"$occ/helper.err" </dev/null &
    helper_pid=$!
    for ((i = 0; i < 600; i++)); do
        grep -q '^holding' "$occ/helper.out" 2>/dev/null && break
        kill -0 "$helper_pid" 2>/dev/null || break
        sleep 0.1
    done
    if ! grep -q '^holding' "$occ/helper.out" 2>/dev/null; then
        kill "$helper_pid" 2>/dev/null
        wait "$helper_pid" 2>/dev/null
        unset helper_pid
        daemon_stop
        result occupancy-helper blocked "the helper could not hold GPU 0: $(cat "$occ/helper.out" "$occ/helper.err" | head -c 300 | tr '\n' ' ')"
    else
        result occupancy-helper pass "$(head -1 "$occ/helper.out")"
        held_at=$(date +%s.%N)
        # From now on no process of this run but the helper may appear on the GPU (one that
        # started while it was free may still be finishing: reported, not a violation).
        "${GV[@]}" watch-apps "$occ/apps-watch.json" --root $$ --helper "$helper_pid" \
            --baseline "$occ/apps-baseline.txt" --since "$held_at" 2>"$occ/apps-watch.stderr" &
        watch_pid=$!
        # The daemon's next NVML reading (every 1 s) must see the helper.
        for ((i = 0; i < 50; i++)); do
            curl -s -o "$occ/daemon-preflight-first-busy.json" "$daemon_url/v1/preflight?require=cuda&gpus=1"
            [[ $(field "$occ/daemon-preflight-first-busy.json" devices.0.occupancy) == busy ]] && break
            sleep 0.2
        done
        note "the daemon saw GPU 0 busy after about $((i / 5)) s: $(field "$occ/daemon-preflight-first-busy.json" devices.0.occupancy)"
        nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv >"$occ/apps-at-busy.csv" 2>&1
        sleep 6  # more probe rounds (cuda every 2 s, JAX and IREE every 5), each a chance to touch it
        curl -s -o "$occ/daemon-preflight-gpus1.json" "$daemon_url/v1/preflight?require=cuda&gpus=1"
        curl -s -o "$occ/daemon-preflight.json" "$daemon_url/v1/preflight?require=cuda"
        curl -s -o "$occ/daemon-health.json" "$daemon_url/v1/health?require=cuda"
        curl -s -o "$occ/metrics-busy.txt" "$daemon_url/metrics"
        env ${occ_env[@]+"${occ_env[@]}"} timeout 120 "$PY" -m gpudiag preflight --no-daemon \
            --require cuda --gpus 1 --format json >"$occ/inline-preflight-gpus1.json" 2>>"$occ/inline.stderr"
        inline_rc=$?
        env ${occ_env[@]+"${occ_env[@]}"} timeout 120 "$PY" -m gpudiag preflight --no-daemon \
            --require cuda,jax --format json >"$occ/inline-preflight-cuda-jax.json" 2>>"$occ/inline.stderr"
        env ${occ_env[@]+"${occ_env[@]}"} timeout 120 "$PY" -m gpudiag health --no-daemon \
            --require cuda --format json >"$occ/inline-health.json" 2>>"$occ/inline.stderr"
        health_rc=$?
        nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv >"$occ/apps-busy.csv" 2>&1
        kill -TERM "$watch_pid" 2>/dev/null
        wait "$watch_pid" 2>/dev/null
        unset watch_pid
        for what in daemon-preflight-gpus1 inline-preflight-gpus1; do
            f=$occ/$what.json
            got=$(blocker_of "$f") state=$(field "$f" devices.0.occupancy)
            ok=1; [[ $got == devices_busy && $state == busy ]] && ok=0
            pass_if "occupancy-$what" "$ok" "blocker=$got devices[0].occupancy=$state (expected devices_busy, busy)"
        done
        got=$(blocker_of "$occ/inline-preflight-cuda-jax.json")
        jax=$(field "$occ/inline-preflight-cuda-jax.json" backends.jax.status)
        # JAX has no free GPU: never ok. Unproven (devices_busy first), or what its
        # installation alone shows (e.g. jax_gpu_backend_absent where no plugin is installed).
        ok=1; [[ $got != none && $jax != ok ]] && ok=0
        pass_if occupancy-inline-preflight-cuda-jax "$ok" "blocker=$got backends.jax.status=$jax (expected not none: JAX has no free GPU, so it is unproven or its installation is blocked)"
        got=$(blocker_of "$occ/daemon-preflight.json")
        ok=1; [[ $got == devices_busy ]] && ok=0
        pass_if occupancy-daemon-preflight "$ok" "without --gpus: blocker=$got (expected devices_busy)"
        for what in daemon-health inline-health; do
            f=$occ/$what.json
            ready=$(field "$f" ready) healthy=$(field "$f" devices.0.healthy) state=$(field "$f" devices.0.occupancy)
            ok=1; [[ $ready == true && $healthy == true && $state == busy ]] && ok=0
            pass_if "occupancy-$what" "$ok" "ready=$ready blocker=$(blocker_of "$f") devices[0].healthy=$healthy occupancy=$state (expected true, true, busy)"
        done
        ok=1; [[ $health_rc -eq 0 && $inline_rc -eq 1 ]] && ok=0
        pass_if occupancy-exit-codes "$ok" "health exit $health_rc (expected 0), preflight --gpus 1 exit $inline_rc (expected 1)"
        ok=1; grep -qE '^gpudiag_gpu_occupancy\{.*state="busy".*\} 1(\.0)?$' "$occ/metrics-busy.txt" && ok=0
        pass_if occupancy-metrics "$ok" "$(grep -E '^gpudiag_gpu_occupancy\{' "$occ/metrics-busy.txt" | tr '\n' ' ')"
        read -r status detail < <("${GV[@]}" judge-apps "$occ/apps-watch.json")
        result occupancy-no-context "$status" "$detail"
        kill -TERM "$helper_pid" 2>/dev/null
        wait "$helper_pid" 2>/dev/null
        unset helper_pid
        stopped=$(date +%s)
        # Free and proven: the daemon's next cuda round after the helper left.
        for ((i = 0; i < 40; i++)); do
            sleep 1
            curl -s -o "$occ/daemon-preflight-after.json" "$daemon_url/v1/preflight?require=cuda&gpus=1"
            read -r status detail < <("${GV[@]}" judge-free "$occ/daemon-preflight-after.json" "$stopped")
            [[ $status == pass ]] && break
        done
        result occupancy-daemon-free-proven "$status" "after $((i + 1)) s: $detail"
        daemon_stop
        env ${occ_env[@]+"${occ_env[@]}"} timeout 120 "$PY" -m gpudiag preflight --no-daemon \
            --require cuda --gpus 1 --format json >"$occ/inline-preflight-after.json" 2>>"$occ/inline.stderr"
        read -r status detail < <("${GV[@]}" judge-free "$occ/inline-preflight-after.json" "$stopped")
        result occupancy-inline-free-proven "$status" "$detail"
    fi
fi

# 10. Round 3: truthful together (issue 23). Eight inline preflights started at the same
# moment on the idle card equal the lone answer and never say devices_busy; the same while a
# helper holds GPU 0 all say devices_busy (never none). An XID hold across a daemon restart
# needs a real XID: recorded as not exercised.
if want together; then
    section "eight preflights together"
    tog=$OUT/together
    mkdir -p "$tog"
    tog_env=()
    [[ -n $first_uuid ]] && tog_env=("CUDA_VISIBLE_DEVICES=$first_uuid")
    together_run() {  # together_run TAG: the lone answer, then 8 at once, into $tog/TAG-*
        env ${tog_env[@]+"${tog_env[@]}"} timeout 200 "$PY" -m gpudiag preflight --no-daemon \
            --require cuda,jax --format json >"$tog/$1-lone.json" 2>"$tog/$1-lone.stderr"
        local pids=() i
        for ((i = 0; i < 8; i++)); do
            env ${tog_env[@]+"${tog_env[@]}"} timeout 200 "$PY" -m gpudiag preflight --no-daemon \
                --require cuda,jax --format json >"$tog/$1-$i.json" 2>"$tog/$1-$i.stderr" &
            pids+=($!)
        done
        wait "${pids[@]}"
    }
    together_run idle
    lone=$(blocker_of "$tog/idle-lone.json")
    same=0 busy=0
    for ((i = 0; i < 8; i++)); do
        got=$(blocker_of "$tog/idle-$i.json")
        [[ $got == "$lone" ]] && same=$((same + 1))
        [[ $got == devices_busy ]] && busy=$((busy + 1))
    done
    ok=1; [[ -n $lone && $same -eq 8 && $busy -eq 0 ]] && ok=0
    pass_if together-idle "$ok" "lone answer $lone; $same of 8 started together gave it, $busy said devices_busy"
    env ${tog_env[@]+"${tog_env[@]}"} "${GV[@]}" hold --mib 1024 --max-s 200 >"$tog/helper.out" 2>"$tog/helper.err" </dev/null &
    helper_pid=$!
    for ((i = 0; i < 600; i++)); do
        grep -q '^holding' "$tog/helper.out" 2>/dev/null && break
        kill -0 "$helper_pid" 2>/dev/null || break
        sleep 0.1
    done
    if grep -q '^holding' "$tog/helper.out" 2>/dev/null; then
        together_run busy
        nonone=0 busy=0
        for ((i = 0; i < 8; i++)); do
            got=$(blocker_of "$tog/busy-$i.json")
            [[ $got != none ]] && nonone=$((nonone + 1))
            [[ $got == devices_busy ]] && busy=$((busy + 1))
        done
        ok=1; [[ $nonone -eq 8 && $busy -eq 8 ]] && ok=0
        pass_if together-busy "$ok" "$busy of 8 said devices_busy, $nonone of 8 not none (helper holds GPU 0)"
    else
        result together-busy blocked "the helper could not hold GPU 0: $(head -c 200 "$tog/helper.err" | tr '\n' ' ')"
    fi
    kill -TERM "$helper_pid" 2>/dev/null
    wait "$helper_pid" 2>/dev/null
    unset helper_pid
    result together-xid-restart blocked "not exercised: a held XID needs a real XID on the card (tests/test_holds.py proves it on the fakes)"
fi

# 11. NVML signals (issue 26): what gpudiag reads with no context, next to nvidia-smi -q.
if want nvml; then
    section "NVML signals"
    timeout 60 "$PY" -m gpudiag probe --backend nvml --format json >"$OUT/nvml-probe.json" 2>"$OUT/nvml-probe.stderr"
    nvidia-smi -q >"$OUT/nvidia-smi-q.txt" 2>&1
    "$PY" - "$OUT/nvml-probe.json" >"$OUT/nvml-signals.txt" 2>&1 <<'PYEOF'
import json, sys
rec = json.load(open(sys.argv[1]))
for d in rec.get("devices", []):
    print(json.dumps(d, sort_keys=True))
for w in rec.get("warnings", []) + rec.get("blockers", []):
    print(w.get("code"), "-", w.get("message"))
PYEOF
    n=$(grep -c '^{' "$OUT/nvml-signals.txt" 2>/dev/null)
    ok=1; [[ ${n:-0} -ge 1 && $(blocker_of "$OUT/nvml-probe.json") == none ]] && ok=0
    pass_if nvml-signals "$ok" "$n GPU(s) read with no context (nvml-signals.txt beside nvidia-smi-q.txt); blocker $(blocker_of "$OUT/nvml-probe.json")"
fi

# 12. Qualification (issue 27): quick and full tiers on the idle card, and the abort path.
if want qualify; then
    section "qualification"
    for tier in quick full; do
        t0=$SECONDS
        inv_snap "before-$tier"
        timeout 200 "$PY" -m gpudiag qualify --tier "$tier" --format json --no-history \
            >"$OUT/qualify-$tier.json" 2>"$OUT/qualify-$tier.stderr"
        rc=$?
        pass_if "qualify-$tier" "$rc" "exit $rc in $((SECONDS - t0)) s (qualify-$tier.json: measurements against the data sheet)"
        inv_snap "after-$tier"
        inv_same "inventory-unchanged-$tier" "before-$tier" "after-$tier"
    done
    inv_snap before-abort
    timeout 200 "$PY" -m gpudiag qualify --tier full --format json --no-history \
        >"$OUT/qualify-abort.json" 2>"$OUT/qualify-abort.stderr" &
    qpid=$!
    sleep 3
    "${GV[@]}" hold --mib 256 --max-s 30 >"$OUT/qualify-helper.out" 2>&1 </dev/null &
    helper_pid=$!
    wait "$qpid"
    kill -TERM "$helper_pid" 2>/dev/null
    wait "$helper_pid" 2>/dev/null
    unset helper_pid
    ok=1; grep -q qualification_aborted "$OUT/qualify-abort.json" 2>/dev/null && ok=0
    pass_if qualify-abort "$ok" "a helper started a context 3 s into the full tier: $(grep -o '"qualification_aborted[^}]*' "$OUT/qualify-abort.json" | head -c 200)"
    inv_snap after-abort
    inv_same inventory-unchanged-abort before-abort after-abort
fi

# 12b. The SDC screen (issue 42): the sdc tier on every idle GPU within its 10 s budget per
# GPU, every check run (none unknown: JAX's CUDA plugin must be here for the GEMMs), no check
# failed; then once more, and the golden program's hash must be bit for bit the same (the
# cross-GPU golden rests on that). qualify-sdc.json keeps every check's cost and conditions.
# Round 5: each run's wall time (the whole command: start, JAX, every GPU) and the coverage the
# tier reported on the card (qualify-sdc-timing.txt; round 4's figures came from the fakes).
if want sdc; then
    section "SDC screen (sdc tier)"
    sdc_walls=()
    for run in 1 2; do
        inv_snap "before-sdc-$run"
        t0=$(date +%s.%N)
        timeout 200 "$PY" -m gpudiag qualify --tier sdc --format json --state-dir "$OUT/sdc-state" \
            >"$OUT/qualify-sdc-$run.json" 2>"$OUT/qualify-sdc-$run.stderr"
        rc_run=$?
        sdc_walls+=("$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')")
        inv_snap "after-sdc-$run"
        inv_same "inventory-unchanged-sdc-$run" "before-sdc-$run" "after-sdc-$run"
        [[ $run == 1 ]] && rc=$rc_run && cp "$OUT/qualify-sdc-1.json" "$OUT/qualify-sdc.json" 2>/dev/null
        # No report the first time (no GPU, NVML unreadable): a second run says nothing more.
        [[ $run == 1 && $rc_run -gt 1 ]] && break
    done
    sdc_summary=$("$PY" - "$OUT/qualify-sdc-1.json" <<'PYEOF' 2>&1
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    print(f"no sdc report ({e}); stderr: {open(sys.argv[1][:-4] + 'stderr').read()[-300:]}")
    sys.exit(1)
bad = []
for q in r["gpus"]:
    checks = {c["check"]: c for c in q.get("checks") or ()}
    costs = " ".join(f"{k}={c['status']}:{c['duration_s']}s" for k, c in checks.items())
    cond = (checks.get("gemm_repeat") or {}).get("conditions") or {}
    print(f"GPU {q['index']} {q['code']} {q['duration_s']} s of {q['budget_s']} s; {costs}; "
          f"bytes tested {q['coverage']['bytes_tested']}; sm {cond.get('sm_clock_mhz')} MHz, "
          f"{cond.get('temperature_c')} C, limit {cond.get('power_limit_w')} W, throttle "
          f"{cond.get('throttle_mask')}")
    if q["code"] != "none" or (q["duration_s"] or 99) > q["budget_s"] or any(
            c["status"] in ("fail", "unknown") and k != "golden" for k, c in checks.items()):
        bad.append(str(q["index"]))
sys.exit(1 if bad or not r["gpus"] else 0)
PYEOF
)
    ok=$?
    printf '%s\n' "$sdc_summary" >"$OUT/qualify-sdc.txt"
    pass_if qualify-sdc "$ok" "exit $rc; $(head -c 600 "$OUT/qualify-sdc.txt")"
    h1=$(grep -o '"output_hash": "[0-9a-f]*"' "$OUT/qualify-sdc-1.json" 2>/dev/null | head -1)
    h2=$(grep -o '"output_hash": "[0-9a-f]*"' "$OUT/qualify-sdc-2.json" 2>/dev/null | head -1)
    ok=1; [[ -n $h1 && $h1 == "$h2" ]] && ok=0
    pass_if qualify-sdc-determinism "$ok" "the golden program's hash in two runs: ${h1:-none} / ${h2:-none}"
    # The timing and coverage, whatever the verdict: each run's wall time, then per GPU the
    # tier's own time against its budget, the bytes tested and what was (not) covered.
    sdc_timing=$("$PY" - "${sdc_walls[*]}" "$OUT"/qualify-sdc-[12].json <<'PYEOF' 2>&1
import json, sys
walls, ok = sys.argv[1].split(), True
for run, path in enumerate(sys.argv[2:], 1):
    wall = walls[run - 1] if run <= len(walls) else "?"
    try:
        r = json.load(open(path))
    except (OSError, ValueError) as e:
        print(f"run {run}: wall {wall} s, no report ({type(e).__name__})")
        ok = False
        continue
    print(f"run {run}: wall {wall} s for {len(r['gpus'])} GPU(s)")
    ok = ok and bool(r["gpus"])
    for q in r["gpus"]:
        cov = q.get("coverage") or {}
        within = q["duration_s"] is not None and q["duration_s"] <= q["budget_s"]
        ok = ok and within and not cov.get("unknown")
        print(f"  GPU {q['index']}: {q['duration_s']} s of its {q['budget_s']} s budget; "
              f"bytes tested {cov.get('bytes_tested')}; checks {json.dumps(cov.get('checks'))}; "
              f"unknown {cov.get('unknown')}; short {cov.get('short')}; said: {q.get('message')}")
sys.exit(0 if ok else 1)
PYEOF
)
    ok=$?
    printf '%s\n' "$sdc_timing" >"$OUT/qualify-sdc-timing.txt"
    pass_if qualify-sdc-timing "$ok" "$(tr '\n' ' ' <"$OUT/qualify-sdc-timing.txt" | head -c 700)"
fi

# 13. Attribution (issue 28): a job that exits 1 with no GPU event is the application's.
if want attribution; then
    section "failure attribution"
    timeout 120 "$PY" -m gpudiag run --gpus 1 --artifacts "$OUT/attribution-run" -- \
        "$PY" -c 'raise SystemExit(1)' >"$OUT/attribution.out" 2>&1
    got=$(sed -n 's/^gpu_failure_attribution=\([a-z]*\).*/\1/p' "$(find "$OUT/attribution-run" -name closeout.txt 2>/dev/null | head -1)" 2>/dev/null | head -1)
    ok=1; [[ $got == application ]] && ok=0
    pass_if attribution-application "$ok" "exit 1, no GPU event: attribution=${got:-missing} (expected application)"
    result attribution-xid blocked "a kernel fault's XID (13/31/43) is not provoked on a shared card by this script"
fi

# 14. The container image (issue 29), where podman and the image are at hand.
if want image; then
    section "container image"
    if command -v podman >/dev/null && podman image exists localhost/gpudiag:0.1.0 2>/dev/null; then
        timeout 120 podman run --rm --runtime runc --network none --device /dev/nvidiactl \
            --device /dev/nvidia0 localhost/gpudiag:0.1.0 probe --format json \
            >"$OUT/image-probe.json" 2>"$OUT/image-probe.stderr"
        pass_if image-probe $? "gpudiag probe inside the image: $(blocker_of "$OUT/image-probe.json")"
    else
        result image-probe blocked "podman or the image localhost/gpudiag:0.1.0 is not on this machine (scripts/build-image.sh builds it)"
    fi
fi

# 15. Runtimes (issue 37): the daemon proves a second job environment (a venv made here from
# what this machine has: no registry is reached) beside its own; a job pinned to the CPU that
# asks the daemon gets its own code (jax_cpu_fallback), never the daemon's ready; a job of the
# runtime's venv is answered from that runtime's proof.
if want runtimes; then
    section "runtimes: the job's environment"
    rt=$OUT/runtime-venv
    site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$PY" -m venv --without-pip "$rt" >"$OUT/runtime-venv.log" 2>&1 \
        && printf '%s\n%s\n' "$REPO" "$site" >"$(ls -d "$rt"/lib/python3*/site-packages)/gpudiag-validate.pth"
    "$rt/bin/python" -m gpudiag fingerprint >"$OUT/runtime-fingerprint.txt" 2>&1
    "$PY" -m pip list 2>/dev/null >"$OUT/runtime-available.txt"
    printf '[backends.jax]\ninterval_s = 600\n[runtimes.validate]\npython = "%s"\nrequire = "jax"\n' \
        "$rt/bin/python" >"$OUT/runtime-daemon.toml"
    if daemon_start runtime-daemon $((PORT + 2)) "$OUT/runtime-daemon.toml"; then
        for ((i = 0; i < 90; i++)); do  # the runtime's first proof (a JAX start on the card)
            curl -s "$daemon_url/metrics" >"$OUT/runtime-metrics.txt" 2>/dev/null
            grep -q '^gpudiag_runtime_backend_up{backend="jax",runtime="validate"}' \
                "$OUT/runtime-metrics.txt" && break
            sleep 1
        done
        up=$(grep '^gpudiag_runtime_backend_up{backend="jax",runtime="validate"}' "$OUT/runtime-metrics.txt" | awk '{print $2}')
        ok=1; [[ $up == 1.0 ]] && ok=0
        pass_if runtime-proven "$ok" "gpudiag_runtime_backend_up{runtime=validate,backend=jax} = ${up:-absent}"
        timeout 180 "$rt/bin/python" -m gpudiag preflight --require jax --daemon-url "$daemon_url" \
            --python "$rt/bin/python" --format json >"$OUT/runtime-job.json" 2>"$OUT/runtime-job.stderr"
        rc=$? src=$(field "$OUT/runtime-job.json" source) got=$(blocker_of "$OUT/runtime-job.json")
        ok=1; [[ $rc -eq 0 && $src == daemon && $got == none ]] && ok=0
        pass_if runtime-job-answered "$ok" "a job of the runtime's venv: exit $rc source=$src blocker=$got"
        JAX_PLATFORMS=cpu timeout 180 "$PY" -m gpudiag preflight --require jax \
            --daemon-url "$daemon_url" --format json >"$OUT/runtime-cpu-job.json" 2>>"$OUT/runtime-job.stderr"
        rc=$? src=$(field "$OUT/runtime-cpu-job.json" source) got=$(blocker_of "$OUT/runtime-cpu-job.json")
        ok=1; [[ $rc -eq 1 && $src == hybrid && $got == jax_cpu_fallback ]] && ok=0
        pass_if runtime-cpu-job-refused "$ok" "JAX_PLATFORMS=cpu asking the daemon: exit $rc source=$src blocker=$got"
        daemon_stop
    else
        result runtime-proven fail "the daemon with a runtime did not become ready (runtime-daemon.log)"
        daemon_stop
    fi
fi

# 11b. Round 5: the job's interpreter decides (issue 48). gpudiag run by its own interpreter
# ($PY: the node's install) for jobs in two venvs, one with JAX (the card's CUDA plugin) and
# one without, found through VIRTUAL_ENV and --python: each answer must equal the job's own
# (gpudiag run by the job's interpreter, --no-daemon), and name the job's interpreter.
if want jobpython; then
    section "jobpython: the job's interpreter"
    site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    for kind in jax plain; do
        jv=$OUT/job-$kind
        "$PY" -m venv --without-pip "$jv" >"$OUT/job-$kind.log" 2>&1 || continue
        pth="$(ls -d "$jv"/lib/python3*/site-packages)/gpudiag-validate.pth"
        if [[ $kind == jax ]]; then printf '%s\n%s\n' "$REPO" "$site" >"$pth"
        else  # gpudiag and its own dependencies importable, JAX and IREE not
            mkdir -p "$jv/deps"
            for dep in click prometheus_client pynvml.py h11 psutil; do
                [[ -e $site/$dep ]] && ln -sf "$site/$dep" "$jv/deps/$dep"
            done
            printf '%s\n%s\n' "$REPO" "$jv/deps" >"$pth"
        fi
        GPUDIAG_JOB_PYTHON="$jv/bin/python" timeout 180 "$jv/bin/python" -m gpudiag preflight \
            --require jax --no-daemon --format json >"$OUT/job-$kind-own.json" 2>>"$OUT/job-$kind.log"
        want_blocker=$(blocker_of "$OUT/job-$kind-own.json")
        for how in VIRTUAL_ENV --python; do
            if [[ $how == VIRTUAL_ENV ]]; then
                env -u GPUDIAG_JOB_PYTHON VIRTUAL_ENV="$jv" PATH="$jv/bin:$PATH" timeout 180 \
                    "$PY" -m gpudiag preflight --require jax --format json >"$OUT/job-$kind-$how.json" 2>>"$OUT/job-$kind.log"
            else
                env -u GPUDIAG_JOB_PYTHON timeout 180 "$PY" -m gpudiag preflight --require jax \
                    --python "$jv/bin/python" --format json >"$OUT/job-$kind-$how.json" 2>>"$OUT/job-$kind.log"
            fi
            got=$(blocker_of "$OUT/job-$kind-$how.json")
            where=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["evidence"]["job_python"]["path"])' \
                "$OUT/job-$kind-$how.json" 2>/dev/null)
            ok=1; [[ -n $want_blocker && $got == "$want_blocker" && $where == "$jv/bin/python" ]] && ok=0
            pass_if "job-$kind-$how" "$ok" "the node's gpudiag for a job venv ($kind) by $how: $got, the job's own: $want_blocker, job_python=$where"
        done
    done
fi

# 11c. Round 5: the job watch (issue 53) on the one GPU. A daemon with short [jobs] windows
# attests two `gpudiag run --gpus 1` on its unix socket: one whose job spins one thread on a
# flag in device memory (a hung collective: full utilization at low power), one whose job
# computes (a JAX bf16 matmul loop). nvidia-smi samples utilization, power, the enforced limit
# and the SM clock once a second during each. The spinner must be named job_stalled (if the
# defaults' utilization and power thresholds hold on this card) and the computing run never;
# the numbers are kept either way: they calibrate job_stalled's defaults
# (docs/validation/job-watch-calibration.md). The power limits and clocks the driver reports
# are read, never set.
if want jobwatch; then
    section "jobwatch: a spinning run and a computing run"
    jw=$OUT/jobwatch
    mkdir -p "$jw"
    jw_s=${GPUDIAG_VALIDATE_JOBWATCH_S:-45}
    stall_s=$(( jw_s / 3 > 0 ? jw_s / 3 : 1 ))
    nvidia-smi -q -d POWER,CLOCK,PERFORMANCE >"$jw/driver-power-clocks.txt" 2>&1
    nvidia-smi --query-gpu=index,power.limit,enforced.power.limit,power.default_limit,power.min_limit,power.max_limit,clocks.max.sm,clocks.max.memory,clocks.applications.graphics,clocks.applications.memory \
        --format=csv >"$jw/driver-limits.csv" 2>&1
    rc=$?
    pass_if jobwatch-driver-limits "$rc" "exit $rc: $(tr '\n' ';' <"$jw/driver-limits.csv" | head -c 500)"
    fields=$("$PY" -c 'import sys; sys.path.insert(0, sys.argv[1]); from gpu_validate import SAMPLE_FIELDS; print(",".join(SAMPLE_FIELDS))' "$REPO/scripts")
    printf '[backends.jax]\ninterval_s = 600\n[jobs]\ninterval_s = 1\nstall_after_s = %s\nstraggler_after_s = %s\n' \
        "$stall_s" "$stall_s" >"$jw/daemon.toml"
    # The socket's folder must be the daemon's alone (0755); the lock folder the jobs' too.
    jw_top=$(mktemp -d /tmp/gpudiag-validate-jobwatch.XXXXXX)
    chmod 755 "$jw_top"
    mkdir -m 755 "$jw_top/daemon"
    mkdir -m 1777 "$jw_top/locks"
    jw_env=("GPUDIAG_LOCK_DIR=$jw_top/locks")
    daemon_args=(--socket "$jw_top/daemon/gpudiag.sock")
    jw_ready=NO
    daemon_start jobwatch/daemon $((PORT + 3)) "$jw/daemon.toml" "${jw_env[@]}" && jw_ready=yes
    daemon_args=()
    note "job watch daemon ready (/readyz) after $((SECONDS - START_S)) s: $jw_ready; [jobs] interval_s = 1, stall_after_s = $stall_s; each run $jw_s s"
    for kind in spin compute; do
        knob=GPUDIAG_VALIDATE_SPINNER
        [[ $kind == compute ]] && knob=GPUDIAG_VALIDATE_COMPUTER
        if [[ -n ${!knob:-} ]]; then
            read -ra job <<<"${!knob}"
        else
            job=("${GV[@]}" "$kind" --seconds "$jw_s")
        fi
        nvidia-smi --query-gpu="$fields" --format=csv,noheader,nounits -l 1 \
            >"$jw/$kind-samples.csv" 2>"$jw/$kind-samples.err" &
        smi_pid=$!
        env "${jw_env[@]}" GPUDIAG_DAEMON_URL="unix:$jw_top/daemon/gpudiag.sock" \
            timeout $((jw_s + 150)) "$PY" -m gpudiag run --gpus 1 --artifacts "$jw/$kind-run" -- \
            "${job[@]}" >"$jw/$kind.out" 2>"$jw/$kind.err" &
        job_pid=$!
        # The daemon's view while the run is open: /v1/health's runs evidence every 2 s.
        : >"$jw/$kind-runs.jsonl"
        while kill -0 "$job_pid" 2>/dev/null; do
            sleep 2
            curl -s -o "$jw/$kind-health.json" "$daemon_url/v1/health?require=nvml" 2>/dev/null \
                && field "$jw/$kind-health.json" evidence.runs >>"$jw/$kind-runs.jsonl"
        done
        wait "$job_pid"
        rc=$?
        unset job_pid
        kill "$smi_pid" 2>/dev/null
        wait "$smi_pid" 2>/dev/null
        unset smi_pid
        closeout=$(find "$jw/$kind-run" -name closeout.json 2>/dev/null | head -1)
        attested=$(field "$closeout" job_record.attested)
        warnings=$(field "$closeout" job_record.warnings)
        codes=$(grep -o '"code": "[a-z_]*"' <<<"$warnings" | sed 's/"code": //; s/"//g' | tr '\n' ' ')
        stalled=$("$PY" -c 'import json, sys
ws = json.loads(sys.argv[1] or "[]")
print(" ".join(json.dumps(w.get("numbers")) for w in ws if w.get("code") == "job_stalled"))' "${warnings:-[]}" 2>/dev/null)
        samples=$("${GV[@]}" samples-summary "$jw/$kind-samples.csv" --skip-s 5 2>&1)
        samples_rc=$?
        printf '%s\n' "$samples" >"$jw/$kind-samples.txt"
        job_said=$(tail -1 "$jw/$kind.out" 2>/dev/null)
        pass_if "jobwatch-$kind-samples" "$samples_rc" "$samples"
        if [[ $kind == spin ]]; then
            ok=1; [[ $rc -eq 0 && -n $stalled ]] && ok=0
            pass_if jobwatch-spin-stalled "$ok" "exit $rc attested=${attested:-none} warnings: ${codes:-none}; job_stalled numbers: ${stalled:-none}; the job said: ${job_said:-nothing} (expected job_stalled where utilization >= 0.9 and power <= 0.4 of the limit)"
        else
            ok=1; [[ $rc -eq 0 && $attested == socket && -z $stalled ]] && ok=0
            pass_if jobwatch-compute-not-stalled "$ok" "exit $rc attested=${attested:-none} warnings: ${codes:-none}; the job said: ${job_said:-nothing} (expected no job_stalled)"
        fi
    done
    daemon_stop
    rm -rf "$jw_top"
fi

# 11d. Round 5: the fabric (issue 51) as this machine's sysfs shows it, whatever it is: every
# HCA with its fw_ver and ports (state, rate), every network interface, the driver's GPU-NIC
# topology, and gpudiag's nic probe (ports, rates, GPU affinity). A record, not a judgement.
sysfs_value() { local v; v=$(cat "$1" 2>/dev/null) || v="?"; printf '%s' "${v:-?}"; }
sysfs_link() { [[ -e $1 ]] && basename "$(readlink -f "$1")" || printf -- '-'; }
if want fabric; then
    section "fabric: sysfs and the nic probe"
    fab=$OUT/fabric
    mkdir -p "$fab"
    hcas=0 ports=0 nets=0
    : >"$fab/sysfs.txt"
    for d in /sys/class/infiniband/*; do
        [[ -e $d ]] || continue
        hcas=$((hcas + 1))
        printf 'hca %s fw_ver=%s hca_type=%s board_id=%s node_type=%s pci=%s numa_node=%s\n' \
            "${d##*/}" "$(sysfs_value "$d/fw_ver")" "$(sysfs_value "$d/hca_type")" \
            "$(sysfs_value "$d/board_id")" "$(sysfs_value "$d/node_type")" \
            "$(sysfs_link "$d/device")" "$(sysfs_value "$d/device/numa_node")" >>"$fab/sysfs.txt"
        for p in "$d"/ports/*; do
            [[ -e $p ]] || continue
            ports=$((ports + 1))
            printf '  port %s state=%s phys_state=%s rate=%s link_layer=%s\n' "${p##*/}" \
                "$(sysfs_value "$p/state")" "$(sysfs_value "$p/phys_state")" \
                "$(sysfs_value "$p/rate")" "$(sysfs_value "$p/link_layer")" >>"$fab/sysfs.txt"
        done
    done
    for n in /sys/class/net/*; do
        [[ -e $n ]] || continue
        nets=$((nets + 1))
        printf 'net %s operstate=%s speed=%s mtu=%s carrier=%s driver=%s pci=%s numa_node=%s\n' \
            "${n##*/}" "$(sysfs_value "$n/operstate")" "$(sysfs_value "$n/speed")" \
            "$(sysfs_value "$n/mtu")" "$(sysfs_value "$n/carrier")" \
            "$(sysfs_link "$n/device/driver")" "$(sysfs_link "$n/device")" \
            "$(sysfs_value "$n/device/numa_node")" >>"$fab/sysfs.txt"
    done
    result fabric-sysfs pass "$hcas HCA(s) with $ports port(s), $nets network interface(s): $(grep -E '^(hca|  port)' "$fab/sysfs.txt" | tr -s ' ' | tr '\n' ';' | head -c 500)"
    nvidia-smi topo -m >"$fab/nvidia-smi-topo.txt" 2>&1
    rc=$?
    pass_if fabric-topology "$rc" "nvidia-smi topo -m: exit $rc (fabric/nvidia-smi-topo.txt)"
    timeout 120 "$PY" -m gpudiag probe --backend nic --wide --format json >"$fab/nic-probe.json" 2>"$fab/nic-probe.stderr"
    rc=$?
    said=$("$PY" - "$fab/nic-probe.json" <<'PYEOF' 2>&1
import json, sys
r = json.load(open(sys.argv[1]))
nic = (r.get("backends") or {}).get("nic") or {}
ports = (nic.get("detail") or {}).get("ports") or []
print(f"blocker={r['gpu_validation_blocker']} status={nic.get('status')} warnings="
      f"{','.join(w['code'] for w in r.get('warnings') or ()) or 'none'}; {len(ports)} port(s): "
      + "; ".join(f"{p.get('port')} {p.get('kind')} {p.get('state')} {p.get('rate_gbps')} Gb/s "
                  f"fw {p.get('fw_ver')} numa {p.get('numa_node')} gpus {json.dumps(p.get('gpus'))}"
                  for p in ports))
PYEOF
)
    ok=$?
    [[ $rc -le 1 ]] || ok=1  # 0 or 1: a verdict either way; more is no answer
    pass_if fabric-nic-probe "$ok" "exit $rc; $(head -c 600 <<<"$said")"
fi

# 12. Round 4: kernel facts decide (issue 38). Another uid (65534) holds a context on GPU 0
# from a process whose command line reads `python3 -m gpudiag.probes cuda`, as a probe's does:
# gpudiag must take it for a user of the GPU (busy), never for a sibling probe, and make no
# context of its own there.
if want identity; then
    section "identity: another user's process named like a probe"
    idn=$OUT/identity
    mkdir -p "$idn"
    # The disguise lives where the other uid can read it ($OUT may sit in a closed folder).
    disguise=$(mktemp -d /tmp/gpudiag-validate-disguise.XXXXXX)
    mkdir -p "$disguise/gpudiag/probes"
    : >"$disguise/gpudiag/__init__.py"
    : >"$disguise/gpudiag/probes/__init__.py"
    cp "$REPO/scripts/gpu_validate.py" "$disguise/gpu_validate.py"
    printf 'import runpy, sys\nsys.argv = ["gpu_validate.py", "hold", "--mib", "512", "--max-s", "120"]\nrunpy.run_path(%s, run_name="__main__")\n' \
        "'$disguise/gpu_validate.py'" >"$disguise/gpudiag/probes/__main__.py"
    chmod -R a+rX "$disguise"
    # A Python the other uid can run (this one may sit under a home it cannot enter).
    sys_py=/usr/bin/python3
    [[ -x $sys_py ]] || sys_py=$(command -v python3)
    if ! command -v setpriv >/dev/null || [[ $(id -u) -ne 0 ]]; then
        result identity-disguised-user blocked "needs root and setpriv to run a second uid"
    else
        (cd / && exec setpriv --reuid 65534 --regid 65534 --clear-groups env -i \
            PATH=/usr/bin:/bin PYTHONPATH="$disguise" ${first_uuid:+CUDA_VISIBLE_DEVICES=$first_uuid} \
            "$sys_py" -m gpudiag.probes cuda) >"$idn/helper.out" 2>"$idn/helper.err" </dev/null &
        helper_pid=$!
        for ((i = 0; i < 300; i++)); do
            grep -q '^holding' "$idn/helper.out" 2>/dev/null && break
            kill -0 "$helper_pid" 2>/dev/null || break
            sleep 0.1
        done
        [[ -r /proc/$helper_pid/cmdline ]] && tr '\0' ' ' <"/proc/$helper_pid/cmdline" >"$idn/helper-cmdline.txt"
        if ! grep -q '^holding' "$idn/helper.out" 2>/dev/null; then
            result identity-disguised-user blocked "uid 65534 could not hold GPU 0: $(cat "$idn/helper.out" "$idn/helper.err" | head -c 300 | tr '\n' ' ')"
        else
            held_at=$(date +%s.%N)
            nvidia-smi --query-compute-apps=pid --format=csv,noheader >"$idn/apps-baseline.txt" 2>&1
            "${GV[@]}" watch-apps "$idn/apps-watch.json" --root $$ --helper "$helper_pid" \
                --baseline "$idn/apps-baseline.txt" --since "$held_at" 2>"$idn/apps-watch.stderr" &
            watch_pid=$!
            env ${first_uuid:+CUDA_VISIBLE_DEVICES=$first_uuid} timeout 120 "$PY" -m gpudiag preflight \
                --no-daemon --require cuda --gpus 1 --format json >"$idn/inline-preflight.json" 2>"$idn/inline.stderr"
            rc=$? got=$(blocker_of "$idn/inline-preflight.json")
            state=$(field "$idn/inline-preflight.json" devices.0.occupancy)
            ok=1; [[ $rc -eq 1 && $got == devices_busy && $state == busy ]] && ok=0
            pass_if identity-disguised-user-is-busy "$ok" "helper argv: $(cat "$idn/helper-cmdline.txt"); exit $rc blocker=$got devices[0].occupancy=$state (expected 1, devices_busy, busy)"
            kill -TERM "$watch_pid" 2>/dev/null
            wait "$watch_pid" 2>/dev/null
            unset watch_pid
            read -r status detail < <("${GV[@]}" judge-apps "$idn/apps-watch.json")
            result identity-no-context "$status" "$detail"
        fi
        kill -TERM "$helper_pid" 2>/dev/null
        wait "$helper_pid" 2>/dev/null
        unset helper_pid
    fi
    rm -rf "$disguise"
fi

# 9. Real texts: what NVML, the driver, the JAX CUDA plugin and IREE's CUDA HAL print for the
# safe faults, verbatim, next to what the fakes print for the same fault.
if want texts; then
    section "real texts against the fakes'"
    fakes=${GPUDIAG_VALIDATE_FAKES:-}
    if [[ -z $fakes ]] && command -v "${CC:-gcc}" >/dev/null; then
        fakes=$OUT/fakes-build
        (cd "$REPO" && "$PY" -c 'import sys; from tests.fakes.build import build_fakes; build_fakes(sys.argv[1])' "$fakes") \
            >"$OUT/fakes-build.log" 2>&1 || fakes=
    fi
    timeout 200 "${GV[@]}" texts "$OUT/texts" ${fakes:+--fakes "$fakes"} >"$OUT/texts.log" 2>&1
    rc=$?
    differ=$(grep -c ': DIFFERS$' "$OUT/texts/comparison.txt" 2>/dev/null)
    if [[ -z $fakes ]]; then
        result texts blocked "real texts kept (exit $rc), no fakes to compare with (gcc missing and GPUDIAG_VALIDATE_FAKES unset)"
    else
        ok=1; [[ $rc -eq 0 && ${differ:-x} == 0 ]] && ok=0
        pass_if texts "$ok" "exit $rc; ${differ:-?} of the fault/layer pairs differ from the fakes (texts/comparison.txt)"
    fi
    rm -rf "$OUT/fakes-build"
fi

# Round 5: the inventory as this run found it and left it (every tier above was checked on its
# own); without the qualify section, the quick tier runs here so that it is checked too.
if want inventory; then
    section "inventory: the GPU as this run found it and left it"
    if ! want qualify; then
        inv_snap before-quick
        timeout 200 "$PY" -m gpudiag qualify --tier quick --format json --no-history \
            >"$OUT/inventory/qualify-quick.json" 2>"$OUT/inventory/qualify-quick.stderr"
        note "the quick tier for the inventory check: exit $?"
        inv_snap after-quick
        inv_same inventory-unchanged-quick before-quick after-quick
    fi
    inv_snap end
    said=$("${GV[@]}" inventory-diff "$OUT/inventory/start.json" "$OUT/inventory/start.json" 2>&1)
    pass_if inventory-read $? "$said (inventory/start.json, start.smi-q.txt, start.nvml.json)"
    inv_same inventory-unchanged-run start end
fi

# The outcome, then one archive of everything.
fails=$(awk -F'\t' '$2 == "fail"' "$CHECKS" | wc -l)
blocked=$(awk -F'\t' '$2 == "blocked"' "$CHECKS" | wc -l)
passes=$(awk -F'\t' '$2 == "pass"' "$CHECKS" | wc -l)
if [[ $has_gpu -eq 0 ]]; then
    outcome="BLOCKED: no GPU (nvidia-smi -L failed); $blocked blocker records, no pass"
elif [[ $fails -gt 0 ]]; then
    outcome="FAIL: $fails failed, $blocked blocked, $passes passed"
elif [[ $blocked -gt 0 ]]; then
    outcome="BLOCKED: $blocked blocked, $passes passed"
else
    outcome="PASS: $passes passed"
fi
note "result: $outcome (in $((SECONDS - START_S)) s)"
archive=$OUT/gpu-validate-$(hostname)-$(date -u +%Y%m%dT%H%M%SZ).tgz
tar czf "$archive" -C "$(dirname "$OUT")" --exclude='gpu-validate-*.tgz' "$(basename "$OUT")" 2>/dev/null \
    && note "archive: $archive"
[[ $outcome == PASS* ]]
