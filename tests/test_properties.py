"""Property tests (hypothesis) for every parser of outside input.

Visibility variables, requirement strings, sizes, device lists, deadlines, HTTP query strings,
the TOML config, JAX and IREE error texts, a probe child's stdout and its observation JSON,
verdict records and their key=value rendering. The property is always the same: any input
gives a value or the parser's own error naming the input, never another exception; where a
format goes both ways, it round-trips. (gpudiag parses no nvidia-smi output: the host probe
keeps it verbatim as evidence, so there is no parser to test.)

Bounded: few examples per property and the real observations are collected once.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpudiag.core.catalog import BLOCKERS, LAYER_ORDER, WARNINGS
from gpudiag.core.classify import classify
from gpudiag.core.classify_iree import parse_status
from gpudiag.core.classify_jax import (
    causes,
    cuda_error_meaning,
    driver_causes,
    gpu_cause,
    runtime_error_meaning,
)
from gpudiag.core.decode import decode
from gpudiag.core.environment import (
    KnownDevice,
    parse_cuda_visible_devices,
    parse_nvidia_visible_devices,
    resolve_list,
)
from gpudiag.core.observations import GpuReadings, JaxObservation
from gpudiag.core.probe_run import ProbeRun
from gpudiag.core.registry import observation_problem
from gpudiag.core.requirement import (
    RequirementError,
    parse_backends,
    parse_devices,
    parse_requirement,
    parse_size,
    parse_timeout,
)
from gpudiag.core.verdict import (
    RecordError,
    Requirement,
    Verdict,
)
from gpudiag.daemon.app import DaemonApp
from gpudiag.daemon.config import ConfigError, DaemonConfig, from_mapping, load_config, parse_listen
from gpudiag.daemon.scheduler import Scheduler
from gpudiag.daemon.snapshot import Snapshot
from gpudiag.daemon.store import HistoryStore
from gpudiag.engine.isolation import _parse_observation
from gpudiag.engine.plan import probes_for
from tests.fakes.build import FakeDriver
from tests.support.daemon import Replay, Runs, host_env, quick_config, wait_for, wsgi
from tests.support.verdicts import verdicts

# CI runs a fixed, bounded set of examples; GPUDIAG_PROPERTY_EXAMPLES=N explores N random
# examples per property (for a longer hunt, not for CI).
_HUNT = int(os.environ.get("GPUDIAG_PROPERTY_EXAMPLES", "0"))
FAST = settings(max_examples=_HUNT or 150, deadline=None, derandomize=not _HUNT,
                suppress_health_check=[HealthCheck.too_slow,
                                       HealthCheck.function_scoped_fixture])
SLOW = settings(FAST, max_examples=_HUNT or 80)

# -- strategies --------------------------------------------------------------------------------
# Text that looks like what people type: digits, letters, separators, units, unicode, controls.
ALPHABET = st.sampled_from(list("0123456789abcdefABCDEF-,:;. _=&%+/\\\"'\t\n\x00éµ日") + [
    "GPU-", "MIG-", "GiB", "MB", "cuda", "jax", "iree", "cpu", "gpu", "local-task", "nan",
    "inf", "void", "all", "NoDevFiles", "-1", "1e309", "0x10", "\u2028", "\x85"])
TYPED = st.lists(ALPHABET, max_size=12).map("".join)
TEXT = st.one_of(TYPED, st.text(max_size=40))

JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                      st.floats(), st.text(max_size=12))
JSON = st.recursive(JSON_LEAF, lambda c: st.one_of(
    st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c, max_size=4)),
    max_leaves=12)


@st.composite
def mutated(draw: st.DrawFn, value: Any) -> Any:
    """``value`` with some of its subtrees replaced, dropped or retyped."""
    roll = draw(st.integers(0, 11))
    if roll == 0:
        return draw(JSON)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if draw(st.integers(0, 15)) == 0:
                continue  # a field goes missing
            out[k] = draw(mutated(v))
        return out
    if isinstance(value, list):
        return [draw(mutated(v)) for v in value[:3]]
    return value


# -- visibility --------------------------------------------------------------------------------
MODES = {"unset", "all", "empty", "list"}
KINDS = {"index", "uuid", "uuid_prefix", "mig_uuid", "mig_legacy", "invalid"}
DEVICES = [KnownDevice(i, f"GPU-f00d{i:04x}-0000-4000-8000-00000000{i:04x}",
                       (f"MIG-f00d{i:04x}-0000-4000-8000-000000000000",) if i == 1 else ())
           for i in range(3)]


@FAST
@given(TEXT | st.none())
def test_visibility_variables_parse_any_value(raw: str | None) -> None:
    for vis in (parse_cuda_visible_devices(raw), parse_nvidia_visible_devices(raw)):
        assert vis.mode in MODES and vis.raw == raw
        assert (vis.mode == "unset") == (raw is None)
        if vis.mode == "list":
            assert raw is not None
            assert [e.raw for e in vis.entries] == [t.strip() for t in raw.strip().split(",")]
            assert {e.kind for e in vis.entries} <= KINDS
        else:
            assert vis.entries == ()
        if vis.mode == "empty":
            assert vis.reason and repr(raw) in vis.reason
        json.dumps(vis.record())
        res = resolve_list(vis, DEVICES)
        assert set(res.indices) <= {d.index for d in DEVICES}
        assert len(set(res.indices)) == len(res.indices)
        assert set(res.ambiguous) <= set(res.unresolved)
        assert set(res.unresolved) <= {e.raw for e in vis.entries}


@FAST
@given(st.lists(st.sampled_from([d.uuid for d in DEVICES] + ["0", "2", "9", "GPU-f00d",
                                                              DEVICES[1].mig_uuids[0]]),
                min_size=1, max_size=5))
def test_a_list_of_real_names_resolves_in_its_order(names: list[str]) -> None:
    res = resolve_list(parse_cuda_visible_devices(",".join(names)), DEVICES)
    assert "9" in res.unresolved or "9" not in names
    assert ("GPU-f00d" in res.ambiguous) == ("GPU-f00d" in names)
    full = [n for n in names if n.startswith(("GPU-f00d0", "MIG-")) or n in ("0", "2")]
    expected: list[int] = []
    for n in full:
        i = int(n) if n.isdigit() else next(d.index for d in DEVICES
                                              if n == d.uuid or n in d.mig_uuids)
        if i not in expected:
            expected.append(i)
    assert list(res.indices) == expected


# -- requirement strings, sizes, devices, deadlines --------------------------------------------
def _error_names(e: RequirementError, text: str) -> None:
    assert repr(text) in str(e) or repr(text.strip()) in str(e) or "too large" in str(e) \
        or any(repr(part.strip()) in str(e) or repr(part.strip().lower()) in str(e)
               or repr(part.strip().partition(":")[0].lower()) in str(e)
               or repr(part.strip().partition(":")[2].lower()) in str(e)
               for part in text.split(","))


@FAST
@given(TEXT)
def test_sizes_parse_or_name_the_bad_value(text: str) -> None:
    try:
        n = parse_size(text)
    except RequirementError as e:
        _error_names(e, text)
        return
    assert isinstance(n, int) and 0 <= n <= 2**63 - 1


UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


@FAST
@given(st.integers(0, 2**20), st.sampled_from(sorted(UNITS)), st.sampled_from(["", " "]))
def test_whole_sizes_round_trip(n: int, unit: str, space: str) -> None:
    assert parse_size(f"{n}{space}{unit}") == n * UNITS[unit]
    assert parse_size(f"{n}{space}{unit.lower()}") == n * UNITS[unit]


@FAST
@given(TEXT)
def test_device_lists_parse_or_name_the_bad_value(text: str) -> None:
    try:
        devs = parse_devices(text)
    except RequirementError as e:
        assert repr(text) in str(e)
        return
    assert devs and len(set(devs)) == len(devs) == len(text.split(","))
    assert parse_devices(",".join(devs)) == devs  # round trip


@FAST
@given(TEXT)
def test_requirement_strings_parse_or_name_the_bad_value(text: str) -> None:
    try:
        backends = parse_backends(text)
    except RequirementError as e:
        _error_names(e, text)
        return
    assert backends and len(set(backends)) == len(backends)
    spec = ",".join(b.spec() for b in backends)
    assert parse_backends(spec) == backends  # the spec form round-trips


@FAST
@given(TEXT, TEXT | st.none(), st.integers(-3, 70) | st.none(), TEXT | st.none())
def test_whole_requirements_are_requirements_or_errors(require: str, devices: str | None,
                                                       min_devices: int | None,
                                                       memory: str | None) -> None:
    try:
        req = parse_requirement(require, devices=devices, min_devices=min_devices,
                                min_free_memory=memory)
    except RequirementError as e:
        assert str(e)
        return
    assert isinstance(req, Requirement)
    json.dumps(req.record())
    assert req.effective_min_devices >= 0


@FAST
@given(TEXT | st.floats() | st.integers())
def test_deadlines_are_positive_finite_seconds_or_errors(value: Any) -> None:
    try:
        seconds = parse_timeout(value)
    except RequirementError as e:
        assert repr(value) in str(e)
        return
    assert math.isfinite(seconds) and 0 < seconds <= 86400


@FAST
@given(TEXT)
def test_history_since_is_a_duration_or_a_usage_error(text: str) -> None:
    import click

    from gpudiag.cli.daemon import parse_since

    try:
        seconds = parse_since(text)
    except click.UsageError as e:
        assert repr(text) in str(e)
        return
    assert seconds >= 0


# -- TOML config -------------------------------------------------------------------------------
KEYS = ["listen", "default_requirement", "preflight_wait_s", "scheduler", "tick_s",
        "jitter_ratio", "backoff_max_s", "backends", "host", "nvml", "cuda", "jax", "iree",
        "enabled", "interval_s", "deadline_s", "xid", "hold_s", "gap_warning_s",
        "heartbeat_s", "telemetry_s", "restart_backoff_max_s", "history", "retention_s",
        "max_bytes", "log", "format", "level", "bogus"]
TOML_VALUE = st.recursive(
    st.one_of(st.booleans(), st.integers(-10, 10**6), st.floats(), TEXT),
    lambda c: st.one_of(st.lists(c, max_size=3),
                        st.dictionaries(st.sampled_from(KEYS), c, max_size=4)),
    max_leaves=15)


@FAST
@given(st.dictionaries(st.sampled_from(KEYS), TOML_VALUE, max_size=6))
def test_any_config_mapping_is_a_config_or_a_config_error(raw: dict[str, Any]) -> None:
    try:
        cfg = from_mapping(raw)
    except ConfigError as e:
        assert str(e)
        return
    assert isinstance(cfg, DaemonConfig)
    assert 0 < cfg.listen_port < 65536 or cfg.listen_port == 0
    assert all(b.interval_s > 0 and b.deadline_s > 0 for b in cfg.backends.values())
    parse_backends(cfg.default_requirement)


@SLOW
@given(st.binary(max_size=200) | TEXT.map(str.encode))
def test_any_config_file_loads_or_fails_with_a_config_error(tmp_path: Path, data: bytes
                                                            ) -> None:
    path = tmp_path / "gpudiag.toml"
    path.write_bytes(data)
    try:
        load_config(path)
    except ConfigError as e:
        assert str(path) in str(e)


@FAST
@given(TEXT)
def test_listen_addresses_parse_or_fail_with_a_config_error(text: str) -> None:
    try:
        host, port = parse_listen(text)
    except ConfigError as e:
        assert str(e)
        return
    assert host and 0 <= port < 65536


# -- JAX and IREE error texts ------------------------------------------------------------------
JAX_SNIPPETS = st.sampled_from([
    "Unable to initialize backend 'cuda': FAILED_PRECONDITION: No visible GPU devices.",
    "failed call to cuInit: CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected",
    "Mismatched PJRT plugin PJRT API version (0.54) and framework PJRT API version 0.61",
    "Unable to use CUDA because of the following issues with CUDA components:\n"
    "Outdated cuDNN installation found.\n",
    "Unable to load CUDA. Is it installed?", "CUDA_ERROR_", "CUDA_ERROR_NOT_A_THING",
    "An NVIDIA GPU may be present on this machine, but a CUDA-enabled jaxlib is not "
    "installed. Falling back to cpu.", "\n\n", "Platforms present are: cpu",
    # Real jax 0.10.2 texts (docs/testing.md).
    "RuntimeError: jaxlib/cuda/versions_helpers.cc:135: operation cuInit(0) failed: "
    "CUDA_ERROR_NO_DEVICE",
    "E1130 15:44:41.808336   32489 platform_util.cc:271] Failed to create stream executor for "
    "device CUDA:0: CUDA Runtime error: : cudaErrorInsufficientDriver: CUDA driver version is "
    "insufficient for CUDA runtime version",
    "Failed to create stream executor for device CUDA:0: Device 0 does not support CUDA "
    "Virtual Memory Management (VMM). VMM is required for device memory allocation in XLA.",
    "Unable to initialize backend 'cuda': INTERNAL: no supported devices found for platform "
    "CUDA", "cudaErrorNotAThing", "cudaErrorDevicesUnavailable"])
NOISY = st.lists(JAX_SNIPPETS | TEXT, max_size=5).map("\n".join)
JAX_OBS_KEYS = ["installed", "versions", "platforms", "registered_platforms", "jax_platforms",
                "backend_errors", "init_error", "required_error", "required_devices",
                "default_backend", "compute", "xla_env", "preallocation_disabled",
                "nvidia_gpu_visible", "devices"]


@FAST
@given(st.dictionaries(st.sampled_from(JAX_OBS_KEYS), JSON | NOISY, max_size=8), NOISY,
       st.sampled_from(["gpu", "cpu"]))
def test_jax_error_texts_classify_without_raising(obs: dict[str, Any], stderr: str,
                                                  platform: str) -> None:
    if observation_problem("jax", obs) is not None:
        return  # malformed: the boundary turns it into probe_error (tested below)
    typed = decode(JaxObservation, obs)
    found = causes(typed, platform, stderr)
    assert all(c.code in BLOCKERS and BLOCKERS[c.code].layer == "jax" and c.message
               for c in found)
    cause = gpu_cause(typed, stderr)
    assert cause is None or cause.code in BLOCKERS


RUNTIME_VERSIONS = st.dictionaries(
    st.sampled_from(["nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime", "jax-cuda12-plugin"]),
    st.none() | st.sampled_from(["12.9.79", "13.0.1", "0.1", "x", "99999999999999999999.1"])
    | TEXT)


@FAST
@given(st.dictionaries(st.sampled_from(JAX_OBS_KEYS), JSON | NOISY, max_size=8),
       RUNTIME_VERSIONS, NOISY, st.none() | st.integers())
def test_driver_causes_from_jax_texts_are_cuda_layer_codes(
        obs: dict[str, Any], versions: dict[str, Any], stderr: str, driver: int | None) -> None:
    obs = {**obs, "versions": versions}
    if observation_problem("jax", obs) is not None:
        return
    found = driver_causes(decode(JaxObservation, obs), stderr, driver)
    assert all(c.code in BLOCKERS and BLOCKERS[c.code].layer == "cuda" and c.message
               for c in found)
    assert len({c.code for c in found}) == len(found)
    meaning = runtime_error_meaning(stderr)
    assert meaning is None or meaning.startswith("cudaError")


@FAST
@given(NOISY)
def test_cuda_error_names_are_explained_or_none(text: str) -> None:
    meaning = cuda_error_meaning(text)
    assert meaning is None or meaning.startswith("CUDA_ERROR_")
    assert (meaning is None) == (re.search(r"\bCUDA_ERROR_[A-Z_]+\b", text) is None)


IREE_TEXT = st.lists(st.sampled_from([
    "c/runtime/src/iree/hal/drivers/cuda/cuda_driver.c:136: ", "FAILED_PRECONDITION; ",
    "UNAVAILABLE; ", "CUDA error 'CUDA_ERROR_NO_DEVICE' (100): ", "(99999999999999999999)",
    "Error querying devices: ", "x.cc:0: ", "NOT_FOUND; ", ":", ";", "\n"]) | TEXT,
    max_size=6).map("".join)


@FAST
@given(IREE_TEXT)
def test_iree_status_texts_parse_without_raising(text: str) -> None:
    st_ = parse_status(text)
    assert (st_.file is None) == (st_.line is None) == (st_.status is None)
    assert st_.line is None or st_.line >= 0
    assert st_.cuda_error is None or st_.cuda_error.startswith("CUDA_ERROR_")
    assert st_.cuda_error is None or st_.cuda_error in text
    assert isinstance(st_.message, str)


# -- a probe child's stdout --------------------------------------------------------------------
@FAST
@given(st.binary(max_size=300) | st.lists(JSON.map(json.dumps), max_size=3).map(
    lambda lines: "\n".join(lines).encode()) | st.just(b"[" * 5000 + b"]" * 5000))
def test_probe_stdout_is_an_observation_or_says_why_not(out: bytes) -> None:
    obs, why = _parse_observation(out)
    assert (obs is None) != (why is None)
    assert obs is None or isinstance(obs, dict)


# -- observation JSON into classify ------------------------------------------------------------
REQUIREMENTS = [parse_requirement(r) for r in (
    "cuda", "nvml", "cuda,jax", "jax:cpu", "iree", "iree:local-task", "cuda,jax,iree")] + [
    parse_requirement("cuda", devices="1", min_free_memory="8GiB", min_devices=2),
    parse_requirement("cuda", devices="GPU-f00d0001-0000-4000-8000-000000000001")]


@pytest.fixture(scope="module")
def real_observations(fakes: FakeDriver, tmp_path_factory: pytest.TempPathFactory
                      ) -> dict[str, ProbeRun]:
    """Real observations from every probe on the fakes (2 GPUs, one with MIG, a busy one)."""
    from gpudiag.core.environment import probe_environment
    from gpudiag.engine.isolation import run_probes

    env = probe_environment(host_env(
        fakes, tmp_path_factory.mktemp("obs"), gpus=2, FAKE_NVML_DEVICE_COUNT=2,
        FAKE_NVML_MIG="0:2", FAKE_NVML_PROCESSES="1:77:5", FAKE_NVML_REMAPPED_ROWS="1:0/1/1/0",
        FAKE_NVML_CLOCKS_EVENT_REASONS="1:0x44", FAKE_NVML_ECC_VOLATILE_CORRECTED="0:2"))
    requests = probes_for(parse_requirement("cuda,jax,iree:cuda,iree:local-task"))
    runs = run_probes(requests, env=env, timeouts=dict.fromkeys(dict(requests), 120.0))
    for name, run in runs.items():
        assert run.ok, (name, run.error, run.stderr_tail[-2000:])
    return {name: replace(run, observation=_trimmed(run.observation))
            for name, run in runs.items()}


def _trimmed(value: Any) -> Any:
    """The same shape with long texts cut (nvidia-smi's XML): mutation stays cheap."""
    if isinstance(value, dict):
        return {k: _trimmed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_trimmed(v) for v in value]
    return value[:200] if isinstance(value, str) else value


def test_real_observations_have_the_shape_classify_reads(real_observations: Runs) -> None:
    for name, run in real_observations.items():
        assert observation_problem(name, run.observation) is None, name


def _runs_with(base: Mapping[str, ProbeRun], observations: Mapping[str, Any]
               ) -> dict[str, ProbeRun]:
    return {n: ProbeRun(n, observations[n], base[n].duration_s,
                        stderr_tail=base[n].stderr_tail) for n in base}


def _classify_all(runs: Mapping[str, ProbeRun], requirements: list[Requirement] = REQUIREMENTS
                  ) -> None:
    for req in requirements:
        verdict = classify(runs, req, host="h", checked_at="2026-11-29T00:00:00.000Z")
        rec = verdict.record()
        json.dumps(rec)
        verdict.kv()
        assert rec["gpu_validation_blocker"] == "none" or rec["gpu_validation_blocker"] in \
            BLOCKERS
        assert all(w["code"] in WARNINGS for w in rec["warnings"])


@SLOW
@given(st.data())
def test_classify_never_raises_on_mutated_real_observations(real_observations: Runs,
                                                            data: st.DataObject) -> None:
    observations = {n: data.draw(mutated(r.observation), label=n)
                    for n, r in real_observations.items()}
    requirement = data.draw(st.sampled_from(REQUIREMENTS), label="requirement")
    _classify_all(_runs_with(real_observations, observations), [requirement])


@SLOW
@given(st.dictionaries(st.sampled_from(["host", "nvml", "cuda", "jax", "iree"]), JSON,
                       min_size=1))
def test_classify_never_raises_on_arbitrary_json(real_observations: Runs,
                                                 junk: dict[str, Any]) -> None:
    observations = {n: junk.get(n, r.observation) for n, r in real_observations.items()}
    runs = _runs_with(real_observations, observations)
    _classify_all(runs)
    verdict = classify(runs, parse_requirement("cuda,jax,iree"), host="h", checked_at="t")
    for name, value in junk.items():
        if value is not None and observation_problem(name, value) is not None:
            # A malformed observation is that probe's probe_error, named in the message.
            errors = [b for b in verdict.blockers if b.code == "probe_error"
                      and b.backend == name]
            assert errors and "malformed observation" in errors[0].message


def test_a_malformed_observation_is_a_probe_error_not_a_crash(real_observations: Runs
                                                              ) -> None:
    observed = real_observations["nvml"].observation
    assert observed is not None
    nvml = dict(observed)
    nvml["devices"] = [{"index": "zero", "memory": "lots"}]
    runs = _runs_with(real_observations, {**{n: r.observation for n, r in
                                             real_observations.items()}, "nvml": nvml})
    verdict = classify(runs, parse_requirement("cuda"), host="h", checked_at="t")
    assert verdict.gpu_validation_blocker == "probe_error"
    assert 'devices[0].index: expected an integer, got "zero"' in verdict.blockers[0].message


# -- HTTP query strings ------------------------------------------------------------------------
# 429: on-demand probe runs (POST /v1/probe, max_age_s) are rate-limited per backend.
ALLOWED_STATUS = {200, 202, 400, 404, 405, 413, 414, 429, 503}


@pytest.fixture(scope="module")
def app(real_observations: Runs, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[DaemonApp]:
    runs = {n: real_observations[n] for n in ("host", "nvml", "cuda")}
    sched = Scheduler(quick_config(preflight_wait_s=2.0), runner=Replay(runs), env={})
    store = HistoryStore(tmp_path_factory.mktemp("http") / "h.sqlite3")

    def record(snap: Snapshot) -> None:
        if snap.full is not None:
            store.record(snap.full)

    sched.on_snapshot(record)
    sched.start()
    wait_for(lambda: sched.snapshot().round_complete, 10)
    yield DaemonApp(sched, store)
    sched.stop()
    store.close()


PARAM_NAMES = st.sampled_from(["require", "devices", "min_devices", "min_free_memory",
                               "max_age_s", "wait_s", "cuda_visible_devices",
                               "nvidia_visible_devices", "visibility", "backend", "limit",
                               "blocked", "since_s", "x", ""])
QUERY = st.one_of(
    TEXT,
    st.lists(st.tuples(PARAM_NAMES, TEXT | st.sampled_from(["0", "1", "cuda", "-1", "1e999",
                                                             "nan", "%zz", "%00", "0.001"])),
             max_size=5).map(lambda ps: "&".join(f"{k}={v}" for k, v in ps)))
PATHS = st.sampled_from(["/metrics", "/v1/preflight", "/v1/probe", "/v1/history", "/healthz",
                         "/readyz", "/", "/v1/", "/metrics/", "//v1/preflight"]) | TEXT
METHODS = st.sampled_from(["GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "get", ""])


@SLOW
@given(PATHS, QUERY, METHODS, st.sampled_from(["0", "", "12", "-1", "abc", "99999999"]))
def test_any_request_is_answered_with_a_known_status_never_500(
        app: DaemonApp, path: str, query: str, method: str, length: str) -> None:
    status, headers, body = wsgi(app, f"{path}?{query}", method=method or "GET")
    assert status in ALLOWED_STATUS, (status, body[:300])
    environ = {"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": query,
               "CONTENT_LENGTH": length, "wsgi.input": None}
    got: dict[str, Any] = {}
    body = b"".join(app(environ, lambda s, h: got.update(status=int(s.split()[0]))))
    assert got["status"] in ALLOWED_STATUS, (got, body[:300])
    if got["status"] >= 400 and method != "HEAD":
        err = json.loads(body)["error"]
        assert err["code"] and err["message"]


# -- verdict records: JSON and key=value -------------------------------------------------------
CODES = st.sampled_from(sorted(BLOCKERS))
@FAST
@given(verdicts())
def test_verdict_records_round_trip_through_json(verdict: Verdict) -> None:
    rec = verdict.record()
    again = Verdict.from_record(json.loads(json.dumps(rec)))
    assert again.record() == rec
    assert again.gpu_validation_blocker == verdict.gpu_validation_blocker


def _read_kv(text: str) -> dict[str, str]:
    """The way a shell or a Slurm script reads it: one line per key, split at the first '='."""
    assert text.endswith("\n")
    out: dict[str, str] = {}
    for line in text[:-1].split("\n"):
        key, sep, value = line.partition("=")
        assert sep and key not in out, line
        out[key] = value
    return out


def _unescape(value: str) -> str:
    r"""Undo kv_value's escapes: \\, \n, \r, and \xHH / \uHHHH for other control and
    bidirectional characters (core/recordtext.py)."""
    simple = {"\\": "\\", "n": "\n", "r": "\r"}
    return re.sub(r"\\(?:([\\nr])|x([0-9a-f]{2})|u([0-9a-f]{4}))",
                  lambda m: simple[m.group(1)] if m.group(1)
                  else chr(int(m.group(2) or m.group(3), 16)), value)


@FAST
@given(verdicts())
def test_kv_lines_are_one_per_key_and_give_back_the_values(verdict: Verdict) -> None:
    text = verdict.kv()
    assert "\r" not in text
    kv = _read_kv(text)
    rec = verdict.record()
    assert kv["gpu_validation_blocker"] == rec["gpu_validation_blocker"]
    assert kv["ready"] == ("true" if rec["ready"] else "false")
    assert _unescape(kv["host"]) == rec["host"]
    assert _unescape(kv["checked_at"]) == rec["checked_at"]
    assert kv["blockers"] == ",".join(b["code"] for b in rec["blockers"])
    for i, b in enumerate(rec["blockers"]):
        assert _unescape(kv[f"blockers.{i}.message"]) == b["message"]
        assert _unescape(kv[f"blockers.{i}.device"]) == (b["device"] or "")
    assert kv["devices.count"] == str(len(rec["devices"]))


RECORD_KEYS = ["schema", "requirement", "blockers", "warnings", "devices", "backends",
               "evidence", "preallocation_disabled", "host", "checked_at", "age_s", "source",
               "gpudiag_version", "backends", "min_devices", "code", "layer", "message",
               "remediation", "status", "duration_s", "index"]


@st.composite
def mutated_once(draw: st.DrawFn, value: Any) -> Any:
    """``value`` with exactly one node (picked along a random path) replaced."""
    if isinstance(value, dict) and value and draw(st.integers(0, 3)):
        key = draw(st.sampled_from(sorted(value)))
        return {**value, key: draw(mutated_once(value[key]))}
    if isinstance(value, list) and value and draw(st.integers(0, 3)):
        i = draw(st.integers(0, len(value) - 1))
        return [*value[:i], draw(mutated_once(value[i])), *value[i + 1:]]
    return draw(JSON)


@FAST
@given(st.data())
def test_from_record_gives_a_verdict_or_a_record_error(data: st.DataObject) -> None:
    valid = data.draw(verdicts()).record()
    candidate = data.draw(st.one_of(mutated_once(valid), mutated(valid), JSON,
                                    st.dictionaries(st.sampled_from(RECORD_KEYS), JSON)))
    try:
        verdict = Verdict.from_record(candidate)
    except RecordError as e:
        assert str(e)
        return
    rec = verdict.record()  # what the CLI renders from a daemon's answer
    json.dumps(rec)
    verdict.kv()
    assert Verdict.from_record(rec).record() == rec
    assert all(f["layer"] in LAYER_ORDER for f in rec["blockers"])


# -- the XID watcher child's JSON lines --------------------------------------------------------
DEEP = b"[" * 5000 + b"]" * 5000
READINGS = st.lists(st.dictionaries(st.sampled_from(["index", "memory", "temperature_c",
                                                     "power_w"]), JSON), max_size=3)
WATCHER_MESSAGE = st.fixed_dictionaries(
    {"type": st.sampled_from(["hello", "xid", "telemetry", "error", "heartbeat", "other"])},
    optional={"devices": JSON, "device_index": JSON, "uuid": JSON, "ts": JSON,
              "message": JSON, "gpus": JSON | READINGS,
              "xid": JSON | st.sampled_from([79, "79", 1e308, float("inf"), True])})
WATCHER_LINE = st.one_of(st.binary(max_size=80), JSON.map(lambda v: json.dumps(v).encode()),
                         WATCHER_MESSAGE.map(lambda d: json.dumps(d).encode()), st.just(DEEP))


@FAST
@given(st.lists(WATCHER_LINE, min_size=1, max_size=6))
def test_watcher_lines_never_break_the_supervisor_or_the_exporter(lines: list[bytes]) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from gpudiag.daemon.config import XidConfig
    from gpudiag.daemon.exporter import SnapshotCollector
    from gpudiag.daemon.snapshot import Snapshot
    from gpudiag.daemon.watcher import XidWatcher

    watcher = XidWatcher(XidConfig(), env={})
    for line in lines:
        why = watcher._handle(line)
        assert why is None or isinstance(why, str)
    state = watcher.state()
    snap = Snapshot(seq=1, published_wall=0.0, results={}, stats={}, scheduled=(),
                    watcher=state, full=None, ready=None)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snap))
    generate_latest(registry)
    # Only well-formed readings reach the exporter: typed, under the nvml probe's names.
    assert all(isinstance(k, int) and isinstance(v, GpuReadings) for k, v in
               state.telemetry.items())


# -- a daemon's answer, as `gpudiag preflight` reads it ------------------------------------------
class _Answers:
    """What the stand-in daemon answers next: status and body."""

    status = 200
    body = b"{}"


@pytest.fixture(scope="module")
def answering_daemon() -> Iterator[str]:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the stdlib names it
            self.send_response(_Answers.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(_Answers.body)))
            self.end_headers()
            self.wfile.write(_Answers.body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@SLOW
@given(st.sampled_from([200, 400, 404, 429, 500, 503]), st.data())
def test_any_daemon_answer_is_a_verdict_or_a_reason(answering_daemon: str, status: int,
                                                    data: st.DataObject) -> None:
    from gpudiag.engine.client import ask_daemon

    valid = data.draw(verdicts()).record()
    body = data.draw(st.one_of(
        st.builds(lambda v: json.dumps(v).encode(), st.one_of(mutated_once(valid), JSON)),
        st.builds(lambda e: json.dumps({"error": e}).encode(), JSON),
        st.binary(max_size=40), st.just(b"[" * 5000 + b"]" * 5000)))
    _Answers.status, _Answers.body = status, body
    answer = ask_daemon(answering_daemon, parse_requirement("cuda"), env={})
    assert (answer.verdict is None) != (answer.reason == "daemon")
    if answer.verdict is not None:
        answer.verdict.kv()
