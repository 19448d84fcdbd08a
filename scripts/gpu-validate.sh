#!/usr/bin/env bash
# Validate gpudiag on a real NVIDIA GPU, with no network, in under 5 minutes.
#
#   scripts/gpu-validate.sh OUTDIR
#
# Writes to OUTDIR: probe/preflight records, 60 s of daemon samples and the GPU memory the
# daemon's own process holds (must be none), the JAX probe's peak GPU memory against the
# card's total, cold timings (bare framework init against the gpudiag probe), safe faults,
# and a `gpudiag run --require jax` closeout. summary.txt lists every check and its outcome.
# Safe on a shared card: it never changes the card's settings and never resets it.
# On a GPU-less host it still runs and every record says why it is blocked (never a pass).
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
: >"$SUMMARY"
gd() { "$PY" -m gpudiag "$@"; }
note() { printf '%s\n' "$*" | tee -a "$SUMMARY"; }
field() { "$PY" -c 'import json,sys; r=json.load(open(sys.argv[1])); print(r.get(sys.argv[2]))' "$@" 2>/dev/null; }
blocker_of() { field "$1" gpu_validation_blocker; }
has_gpu=0
nvidia-smi -L >/dev/null 2>&1 && has_gpu=1

note "# gpudiag GPU validation, $(date -u +%Y-%m-%dT%H:%M:%SZ), host $(hostname)"
{
    echo "python: $("$PY" --version 2>&1) ($PY)"
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    nvidia-smi -L 2>&1 || true
    "$PY" -m pip list 2>/dev/null | grep -iE '^(jax|jaxlib|jax-cuda|nvidia-ml-py|iree|click|prometheus|rich) ' || true
} >"$OUT/environment.txt" 2>&1
note "gpu present (nvidia-smi -L): $has_gpu"

# 1. Probe every backend; preflight cuda,jax as JSON and kv.
timeout 300 "$PY" -m gpudiag probe --json >"$OUT/probe.json" 2>"$OUT/probe.stderr"
note "probe (all backends): exit $? blocker=$(blocker_of "$OUT/probe.json")"
timeout 300 "$PY" -m gpudiag preflight --require cuda,jax --format json >"$OUT/preflight-cuda-jax.json" 2>>"$OUT/probe.stderr"
note "preflight cuda,jax: exit $? blocker=$(blocker_of "$OUT/preflight-cuda-jax.json") preallocation_disabled=$(field "$OUT/preflight-cuda-jax.json" preallocation_disabled)"
timeout 300 "$PY" -m gpudiag preflight --require cuda,jax --format kv >"$OUT/preflight-cuda-jax.kv" 2>>"$OUT/probe.stderr"
note "preflight cuda,jax kv: exit $?"

# 2. The peak GPU memory of the JAX probe with preallocation disabled, against the total.
total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
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
note "jax probe peak GPU memory: ${peak} MiB of ${total_mib:-?} MiB (preallocation disabled)"

# 3. Cold timings: the bare framework init against the gpudiag probe (median of 3 each).
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
            t = time.perf_counter(); subprocess.run(argv, capture_output=True); ts.append(time.perf_counter() - t)
        return statistics.median(ts)
    b = med([sys.executable, "-c", bare])
    g = med([sys.executable, "-m", "gpudiag", "probe", "--backend", backend, "--json"])
    lines.append(f"{name}: bare {b*1000:.0f} ms, gpudiag probe {g*1000:.0f} ms, ratio {g/b:.2f}")
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
sed 's/^/timing: /' "$OUT/timings.txt" >>"$SUMMARY" 2>/dev/null

# 4. Faults that are safe on a shared card.
fault() {  # fault NAME EXPECTED -- ENV... -- ARGS...
    local name=$1 expected=$2; shift 2
    local envs=() args=()
    [[ $1 == -- ]] && shift
    while [[ $# -gt 0 && $1 != -- ]]; do envs+=("$1"); shift; done
    [[ ${1:-} == -- ]] && shift
    args=("$@")
    env "${envs[@]}" timeout 300 "$PY" -m gpudiag preflight "${args[@]}" --format json \
        >"$OUT/fault-$name.json" 2>"$OUT/fault-$name.stderr"
    local rc=$? got
    got=$(blocker_of "$OUT/fault-$name.json")
    local verdict=MISMATCH
    [[ $got == "$expected" ]] && verdict=ok
    note "fault $name: exit $rc blocker=$got expected=$expected -> $verdict"
}
first_uuid=$(nvidia-smi --query-gpu=uuid --format=csv,noheader 2>/dev/null | head -1)
fault cvd-empty visible_devices_empty -- CUDA_VISIBLE_DEVICES= -- --require cuda
fault cvd-invalid visible_devices_invalid -- CUDA_VISIBLE_DEVICES=7 -- --require cuda
if [[ -n $first_uuid ]]; then
    fault cvd-uuid none -- "CUDA_VISIBLE_DEVICES=$first_uuid" -- --require cuda
fi
fault jax-platforms-cpu jax_cpu_fallback -- JAX_PLATFORMS=cpu -- --require cuda,jax
fault leaked-prealloc jax_preallocation_enabled -- XLA_PYTHON_CLIENT_PREALLOCATE=true -- --require cuda,jax
fault jax-deadline probe_timeout -- -- --require jax --timeout 0.3

# 5. The daemon for 60 s: /metrics and /v1/preflight samples; GPU memory of its own process.
PORT=${GPUDIAG_VALIDATE_PORT:-19477}
STATE=$(mktemp -d)
"$PY" -m gpudiag serve --listen "127.0.0.1:$PORT" --state-dir "$STATE" --log-format json \
    >"$OUT/daemon.stdout" 2>"$OUT/daemon.log" &
daemon_pid=$!
for i in 1 2 3 4 5 6; do
    sleep 10
    curl -s -o "$OUT/metrics-$i.txt" -w '%{http_code} %{time_total}\n' \
        "http://127.0.0.1:$PORT/metrics" >>"$OUT/daemon-samples.txt" 2>&1
    curl -s -o "$OUT/daemon-preflight-$i.json" -w '%{http_code} %{time_total}\n' \
        "http://127.0.0.1:$PORT/v1/preflight?require=cuda" >>"$OUT/daemon-samples.txt" 2>&1
done
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv >"$OUT/daemon-compute-apps.csv" 2>&1
if grep -qE "^$daemon_pid," "$OUT/daemon-compute-apps.csv"; then
    note "daemon GPU memory: daemon pid $daemon_pid HOLDS GPU memory -> FAIL"
else
    note "daemon GPU memory: daemon pid $daemon_pid holds none -> ok"
fi
note "daemon samples (http code, seconds): $(tr '\n' ';' <"$OUT/daemon-samples.txt")"
kill "$daemon_pid" 2>/dev/null; wait "$daemon_pid" 2>/dev/null
rm -rf "$STATE"

# 6. gpudiag run --require jax of a small JAX program, with its closeout.
cat >"$OUT/small_jax.py" <<'PYEOF'
import jax, jax.numpy as jnp
x = jnp.arange(1024.0)
print("backend", jax.default_backend(), "devices", jax.devices(), "sum", float((x * 2).sum()))
PYEOF
timeout 300 "$PY" -m gpudiag run --require jax --artifacts "$OUT/run" -- "$PY" "$OUT/small_jax.py" \
    >"$OUT/run.stdout" 2>"$OUT/run.stderr"
rc=$?
closeout=$(find "$OUT/run" -name closeout.txt 2>/dev/null | head -1)
note "gpudiag run --require jax: exit $rc; closeout: $(grep -E '^(gpu_validation_blocker|preallocation_disabled|gpu_execution_route)=' "$closeout" 2>/dev/null | tr '\n' ' ')"

# 7. IREE: the carried module compiled elsewhere for a CUDA target the compiler supports.
for vmfb in "$REPO"/validation-assets/*.vmfb; do
    [[ -f $vmfb ]] || continue
    "$PY" - "$vmfb" >>"$OUT/iree-module.txt" 2>&1 <<'PYEOF'
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
[[ -f $OUT/iree-module.txt ]] && note "iree module: $(tr '\n' ' ' <"$OUT/iree-module.txt")"
note "done"
