"""The pytest plugin end to end: real pytest sessions (pytester) and real pytest-xdist workers
on the fake driver; verdicts, distinct GPUs per worker, skips and failures with the blocker
code, JUnit XML properties, real JAX on the CPU, and no lock left behind.

The inner sessions load the plugin through its installed ``pytest11`` entry point, exactly as
a user's project would.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from gpudiag.engine.locks import release, try_lock
from tests.fakes.build import FakeDriver
from tests.support.daemon import Daemon, daemon_toml, host_env, write_config
from tests.support.host import EnvFactory

pytest_plugins = ["pytester"]

UseEnv = Callable[[Mapping[str, str]], None]


def gpu_uuid(i: int) -> str:
    return f"GPU-f00d{i:04x}-0000-4000-8000-00000000{i:04x}"


@pytest.fixture
def use_env(monkeypatch: pytest.MonkeyPatch) -> UseEnv:
    """``use_env(env)``: the inner pytest session runs with exactly ``env``."""

    def apply(env: Mapping[str, str]) -> None:
        for key in list(os.environ):
            if key not in env:
                monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, value)

    return apply


def locks_free(lock_dir: Path, uuids: list[str]) -> list[str]:
    """The UUIDs among ``uuids`` whose lock some process still holds."""
    held = []
    for uuid in uuids:
        lk = try_lock(lock_dir, uuid)
        if lk is None:
            held.append(uuid)
        else:
            release([lk])
    return held


def properties(junit: Path) -> dict[str, dict[str, str]]:
    """Each test case's JUnit XML properties, by test name."""
    out: dict[str, dict[str, str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        out[case.attrib["name"]] = {p.attrib["name"]: p.attrib["value"]
                                    for p in case.iter("property")}
    return out


RECORDING_TESTS = """
import json, os
import pytest

AT_IMPORT = os.environ.get("CUDA_VISIBLE_DEVICES")  # the GPUs are admitted before this import

def _record(name):
    line = {{"test": name, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
             "at_import": AT_IMPORT,
             "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
             "NVIDIA_VISIBLE_DEVICES": os.environ.get("NVIDIA_VISIBLE_DEVICES"),
             "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS"),
             "XLA_PYTHON_CLIENT_PREALLOCATE": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")}}
    with open({out!r}, "a") as f:
        f.write(json.dumps(line) + "\\n")

@pytest.mark.parametrize("i", range({count}))
@pytest.mark.gpu(n=1, require="cuda")
def test_on_gpu(i, gpu_devices, gpu_verdict):
    _record(f"test_on_gpu[{{i}}]")
    assert gpu_verdict.ready
    assert [d.uuid for d in gpu_devices] == [os.environ["CUDA_VISIBLE_DEVICES"]]

def test_unmarked():
    assert True
"""


def test_xdist_workers_each_get_one_distinct_full_uuid(
        pytester: pytest.Pytester, gpu_env: EnvFactory, use_env: UseEnv, tmp_path: Path) -> None:
    lock_dir, out = tmp_path / "locks", tmp_path / "seen.jsonl"
    use_env(gpu_env(FAKE_NVML_DEVICE_COUNT=4, GPUDIAG_LOCK_DIR=str(lock_dir)))
    pytester.makepyfile(test_gpus=RECORDING_TESTS.format(out=str(out), count=16))
    junit = tmp_path / "junit.xml"
    result = pytester.runpytest_subprocess("-n", "4", "-p", "no:cacheprovider",
                                           f"--junitxml={junit}", timeout=240)
    result.assert_outcomes(passed=17)
    seen = [json.loads(line) for line in out.read_text().splitlines()]
    by_worker: dict[str, set[str | None]] = {}
    for rec in seen:
        assert rec["CUDA_VISIBLE_DEVICES"] == rec["NVIDIA_VISIBLE_DEVICES"] == rec["at_import"]
        assert rec["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
        assert rec["JAX_PLATFORMS"] is None  # no JAX in the requirement: untouched
        by_worker.setdefault(rec["worker"], set()).add(rec["CUDA_VISIBLE_DEVICES"])
    assert len(by_worker) >= 2, by_worker  # xdist spread the tests over workers
    uuids = [next(iter(s)) for s in by_worker.values()]
    assert all(len(s) == 1 for s in by_worker.values()), by_worker
    assert len(set(uuids)) == len(uuids), by_worker  # distinct GPUs
    assert set(uuids) <= {gpu_uuid(i) for i in range(4)}  # full UUIDs
    # Each worker's verdict reaches the controller's terminal summary.
    result.stdout.fnmatch_lines(["*gpudiag*", "*[[]gw*gpu(n=1, require='cuda'): ready*"])
    # Every one of the 4 workers admitted a GPU of its own, also those that ran few tests.
    admitted = dict(re.findall(r"^\[(gw\d)\] gpudiag: gpu\(n=1, require='cuda'\): ready "
                               r".*; GPUs (\S+)$", result.stdout.str(), re.MULTILINE))
    assert sorted(admitted) == ["gw0", "gw1", "gw2", "gw3"], result.stdout.str()
    assert sorted(admitted.values()) == [gpu_uuid(i) for i in range(4)]
    assert all(admitted[w] == next(iter(s)) for w, s in by_worker.items())
    props = properties(junit)
    for rec in seen:
        p = props[rec["test"]]
        assert p["gpu_validation_blocker"] == "none"
        assert p["gpu_uuids"] == rec["CUDA_VISIBLE_DEVICES"]
    assert "gpu_validation_blocker" not in props["test_unmarked"]
    assert locks_free(lock_dir, [gpu_uuid(i) for i in range(4)]) == []


BLOCKED_TESTS = """
import pytest

@pytest.mark.gpu(require="cuda")
def test_needs_gpu():
    raise AssertionError("a blocked GPU test must never run")

@pytest.mark.gpu(n=2)
def test_needs_two(gpu_devices):
    raise AssertionError("a blocked GPU test must never run")

def test_unmarked():
    assert True
"""


@pytest.mark.parametrize("how", ["skip", "--gpu-required", "GPUDIAG_GPU_REQUIRED=1"])
def test_a_driver_fault_skips_or_fails_gpu_tests_with_its_code(
        pytester: pytest.Pytester, gpu_env: EnvFactory, use_env: UseEnv, tmp_path: Path,
        how: str) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=2, FAKE_NVML_INIT_ERROR=9,
                  GPUDIAG_LOCK_DIR=str(tmp_path / "locks"))
    if how.startswith("GPUDIAG_"):
        env["GPUDIAG_GPU_REQUIRED"] = "1"
    use_env(env)
    pytester.makepyfile(test_blocked=BLOCKED_TESTS)
    junit = tmp_path / "junit.xml"
    args = ["-rs", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    result = pytester.runpytest_subprocess(*args, *([how] if how.startswith("--") else []),
                                           timeout=180)
    # The verdict is at the top of the run, with its code and where it came from.
    result.stdout.fnmatch_lines(["collected 3 items",
                                 "gpudiag: gpu(n=2, require='cuda'): BLOCKED driver_not_loaded"
                                 " (source inline, age *"])
    props = properties(junit)
    for name in ("test_needs_gpu", "test_needs_two"):
        assert props[name]["gpu_validation_blocker"] == "driver_not_loaded"
        assert props[name]["gpu_uuids"] == ""
    if how == "skip":
        result.assert_outcomes(passed=1, skipped=2)
        result.stdout.fnmatch_lines(["SKIPPED * gpudiag: driver_not_loaded: *Remediation: *"])
    else:
        result.assert_outcomes(passed=1, failed=2)
        text = result.stdout.str()
        assert "a blocked GPU test must never run" not in text
        assert '"gpu_validation_blocker": "driver_not_loaded"' in text
        assert "GPU test cannot run (--gpu-required / GPUDIAG_GPU_REQUIRED=1)" in text


def test_under_q_the_verdict_lines_are_said_once(
        pytester: pytest.Pytester, gpu_env: EnvFactory, use_env: UseEnv,
        tmp_path: Path) -> None:
    use_env(gpu_env(FAKE_NVML_DEVICE_COUNT=1, GPUDIAG_LOCK_DIR=str(tmp_path / "locks")))
    pytester.makepyfile(test_one="""
        import pytest

        @pytest.mark.gpu(n=1, require="cuda")
        def test_gpu():
            pass
    """)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", timeout=120)
    result.assert_outcomes(passed=1)
    text = result.stdout.str()
    assert text.count("gpudiag: gpu(n=1, require='cuda'): ready") == 1, text
    assert text.count("gpudiag: environment set:") == 1, text


def test_a_session_without_gpu_tests_probes_nothing(
        pytester: pytest.Pytester, gpu_env: EnvFactory, use_env: UseEnv, tmp_path: Path) -> None:
    lock_dir = tmp_path / "locks"
    use_env(gpu_env(FAKE_NVML_DEVICE_COUNT=2, GPUDIAG_LOCK_DIR=str(lock_dir)))
    pytester.makepyfile(test_plain="""
        import os, sys

        def test_plain():
            # The plugin is loaded, but gpudiag's engine was never imported nor run.
            assert "gpudiag.pytest_plugin" in sys.modules
            assert not [m for m in sys.modules if m.startswith(("gpudiag.engine",
                        "gpudiag.runner", "gpudiag.core.requirement",
                        "gpudiag.pytest_plugin.session"))]
            assert "CUDA_VISIBLE_DEVICES" not in os.environ
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=120)
    result.assert_outcomes(passed=1)
    assert "gpudiag:" not in result.stdout.str()  # no verdict line
    assert not lock_dir.exists()


def test_a_wrong_marker_fails_that_test_naming_the_fix(
        pytester: pytest.Pytester, bare_env: dict[str, str], use_env: UseEnv) -> None:
    use_env(bare_env)
    pytester.makepyfile(test_wrong="""
        import pytest

        @pytest.mark.gpu(n=1, require="cudaa")
        def test_typo():
            pass

        @pytest.mark.gpu(n=-1)
        def test_negative():
            pass

        @pytest.mark.gpu(n=0, require="cuda")
        def test_no_gpu_for_a_gpu_requirement():
            pass
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=120)
    result.assert_outcomes(errors=3)
    result.stdout.fnmatch_lines(["*gpu marker: require='cudaa': *use @pytest.mark.gpu(*",
                                 "*gpu marker: n=-1 must be a whole number*",
                                 "*gpu marker: n=0 but require='cuda' needs a GPU*"])


ONE_GPU_TEST = """
import os
import pytest

@pytest.mark.gpu
def test_gpu():
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-f00d0000-0000-4000-8000-000000000000"
"""


@pytest.mark.parametrize("held_by", ["a gpudiag lock", "another process"])
def test_a_worker_that_finds_no_free_gpu_waits_then_is_devices_busy(
        pytester: pytest.Pytester, gpu_env: EnvFactory, use_env: UseEnv, tmp_path: Path,
        held_by: str) -> None:
    lock_dir = tmp_path / "locks"
    knobs = {"FAKE_NVML_PROCESSES": "0:4242:100"} if held_by == "another process" else {}
    use_env(gpu_env(FAKE_NVML_DEVICE_COUNT=1, GPUDIAG_LOCK_DIR=str(lock_dir), **knobs))
    other_job = try_lock(lock_dir, gpu_uuid(0)) if held_by == "a gpudiag lock" else None
    pytester.makepyfile(test_busy=ONE_GPU_TEST)
    started = time.monotonic()
    try:
        result = pytester.runpytest_subprocess("-rs", "-p", "no:cacheprovider",
                                               "--gpu-timeout", "1.5", timeout=120)
    finally:
        release([other_job] if other_job else [])
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED * gpudiag: devices_busy: waited 1.5 s *"])
    assert time.monotonic() - started >= 1.5  # it did wait


def test_a_waiting_worker_gets_the_gpu_when_the_other_job_ends(
        pytester: pytest.Pytester, gpu_env: EnvFactory, use_env: UseEnv, tmp_path: Path) -> None:
    lock_dir = tmp_path / "locks"
    use_env(gpu_env(FAKE_NVML_DEVICE_COUNT=1, GPUDIAG_LOCK_DIR=str(lock_dir)))
    other_job = try_lock(lock_dir, gpu_uuid(0))
    assert other_job is not None
    ends = threading.Timer(2.0, release, args=([other_job],))  # the other job ends after 2 s
    ends.start()
    try:
        pytester.makepyfile(test_wait=ONE_GPU_TEST)
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--gpu-timeout", "60",
                                               timeout=120)
    finally:
        ends.cancel()
        release([other_job])
    result.assert_outcomes(passed=1)


def test_jax_cpu_markers_really_run_jax_on_the_cpu(
        pytester: pytest.Pytester, gpu_env: EnvFactory, use_env: UseEnv, tmp_path: Path) -> None:
    use_env(gpu_env(FAKE_NVML_DEVICE_COUNT=2, GPUDIAG_LOCK_DIR=str(tmp_path / "locks")))
    pytester.makepyfile(test_jaxcpu="""
        import os
        import jax  # imported at collection, before the plugin sets the environment
        import jax.numpy as jnp
        import pytest

        @pytest.mark.gpu(require="jax:cpu")
        def test_on_cpu(gpu_verdict, gpu_devices):
            assert gpu_verdict.ready and gpu_devices == ()
            assert os.environ["JAX_PLATFORMS"] == "cpu"
            assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
            assert [d.platform for d in jax.devices()] == ["cpu"]
            assert float(jnp.arange(4.0).sum()) == 6.0
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=240)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["gpudiag: gpu(n=0, require='jax:cpu'): ready *(none: CPU only)"])


def test_no_lock_survives_a_killed_worker(
        pytester: pytest.Pytester, gpu_env: EnvFactory, use_env: UseEnv, tmp_path: Path) -> None:
    lock_dir = tmp_path / "locks"
    use_env(gpu_env(FAKE_NVML_DEVICE_COUNT=2, GPUDIAG_LOCK_DIR=str(lock_dir)))
    pytester.makepyfile(test_kill="""
        import os, signal
        import pytest

        @pytest.mark.gpu
        def test_killed():
            os.kill(os.getpid(), signal.SIGKILL)

        @pytest.mark.gpu
        @pytest.mark.parametrize("i", range(4))
        def test_fine(i):
            assert os.environ["CUDA_VISIBLE_DEVICES"].startswith("GPU-")
    """)
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider",
                                           "--max-worker-restart=2", timeout=240)
    result.assert_outcomes(passed=4, failed=1)  # the killed worker's test: "crashed"
    assert lock_dir.is_dir()  # GPUs were admitted ...
    assert locks_free(lock_dir, [gpu_uuid(0), gpu_uuid(1)]) == []  # ... and none is held


def test_the_daemon_answers_first_when_one_listens(
        pytester: pytest.Pytester, fakes: FakeDriver, use_env: UseEnv, tmp_path: Path) -> None:
    env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_NVML_DEVICE_COUNT=2)
    env["GPUDIAG_LOCK_DIR"] = str(tmp_path / "locks")
    daemon = Daemon(env, write_config(tmp_path / "gpudiag.toml", daemon_toml()), tmp_path / "sd")
    try:
        daemon.wait_ready()
        use_env({**env, "GPUDIAG_DAEMON_URL": daemon.url})
        pytester.makepyfile(test_daemon="""
            import os
            import pytest

            @pytest.mark.gpu(n=1, require="cuda")
            def test_gpu(gpu_verdict):
                assert gpu_verdict.source == "daemon"
                assert os.environ["CUDA_VISIBLE_DEVICES"] == os.environ["NVIDIA_VISIBLE_DEVICES"]
        """)
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=120)
    finally:
        daemon.stop()
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["gpudiag: gpu(n=1, require='cuda'): ready (source daemon, "
                                 "age * s); GPUs GPU-f00d0000-0000-4000-8000-000000000000"])


def test_jax_started_before_a_non_literal_marker_is_seen_is_reported(
        pytester: pytest.Pytester, gpu_env: EnvFactory, use_env: UseEnv, tmp_path: Path) -> None:
    use_env(gpu_env(FAKE_NVML_DEVICE_COUNT=1, GPUDIAG_LOCK_DIR=str(tmp_path / "locks"),
                    JAX_PLATFORMS="cpu"))
    pytester.makepyfile(test_early="""
        import jax
        import pytest

        DEVICES = jax.devices()  # starts JAX's backends during collection
        REQUIRE = "jax:" + "cpu"  # not a literal: only seen after collection

        @pytest.mark.gpu(require=REQUIRE)
        def test_cpu():
            assert DEVICES[0].platform == "cpu"
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=240)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["gpudiag: WARNING: JAX's backends were already started during "
                                 "collection*move device use into tests or fixtures"])


def test_the_complete_example_in_docs_runs(
        pytester: pytest.Pytester, gpu_env: EnvFactory, use_env: UseEnv, tmp_path: Path) -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "pytest.md").read_text()
    example = text.split("## A complete example", 1)[1].split("```python\n", 1)[1]
    use_env(gpu_env(FAKE_NVML_DEVICE_COUNT=2, GPUDIAG_LOCK_DIR=str(tmp_path / "locks")))
    pytester.makepyfile(test_model=example.split("```", 1)[0])
    junit = tmp_path / "junit.xml"
    result = pytester.runpytest_subprocess("-rs", "-p", "no:cacheprovider",
                                           f"--junitxml={junit}", timeout=240)
    # No real JAX GPU stack on the fakes: the GPU test skips naming why; the others run.
    result.assert_outcomes(passed=2, skipped=1)
    code = properties(junit)["test_matmul_runs_on_the_admitted_gpu"]["gpu_validation_blocker"]
    assert code.startswith("jax_"), code
    result.stdout.fnmatch_lines([f"SKIPPED * gpudiag: {code}: *Remediation: *"])


@pytest.mark.parametrize(("source", "wanted"), [
    ("import pytest\n@pytest.mark.gpu(n=2, require='cuda,jax')\ndef test_a(): pass\n",
     {"cuda,jax": 2}),
    ("from pytest import mark\n@mark.gpu\ndef test_a(): pass\n"
     "@mark.gpu(1, 'jax:cpu')\ndef test_b(): pass\n", {"cuda": 1, "jax:cpu": 1}),
    ("import pytest\npytestmark = pytest.mark.gpu(require='jax:cpu')\n", {"jax:cpu": 0}),
    ("def test_a(gpu_devices): pass\n", {"cuda": 1}),
    ("import pytest\n@pytest.mark.gpu(require='jax:cpu')\ndef test_a(gpu_verdict): pass\n",
     {"jax:cpu": 0}),
    ("import pytest\nN = 2\n@pytest.mark.gpu(n=N)\ndef test_a(): pass\n", {}),
    ("import pytest\n@pytest.mark.gpu(require='cudaa')\ndef test_a(): pass\n", {}),
    ("def test_a(:\n", {}),
    ("def test_plain(): assert 'mark.gpu'\n", {}),
])
def test_gpu_tests_are_read_from_the_source_before_import(source: str,
                                                          wanted: dict[str, int]) -> None:
    from gpudiag.pytest_plugin.session import scan_source

    assert scan_source(source) == wanted


def test_deselected_gpu_tests_give_their_gpus_back_before_the_first_test(
        pytester: pytest.Pytester, gpu_env: EnvFactory, use_env: UseEnv, tmp_path: Path) -> None:
    lock_dir = tmp_path / "locks"
    use_env(gpu_env(FAKE_NVML_DEVICE_COUNT=1, GPUDIAG_LOCK_DIR=str(lock_dir)))
    pytester.makepyfile(test_deselect=f"""
        import os
        from pathlib import Path
        import pytest
        from gpudiag.engine.locks import release, try_lock

        @pytest.mark.gpu
        def test_gpu():
            pass

        def test_plain():
            assert "CUDA_VISIBLE_DEVICES" not in os.environ
            lk = try_lock(Path({str(lock_dir)!r}), {gpu_uuid(0)!r})
            assert lk is not None, "the deselected GPU test's lock is still held"
            release([lk])
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "plain",
                                           timeout=120)
    result.assert_outcomes(passed=1, deselected=1)
    assert lock_dir.is_dir()  # the source's marker admitted the GPU before the import


@pytest.mark.parametrize(("args", "ini", "message"), [
    (["--gpu-timeout", "-1"], "", "--gpu-timeout -1 must be between 0 and 86400 s"),
    ([], "gpu_timeout = soon\n", "gpu_timeout = 'soon' is not a number of seconds*"),
])
def test_a_wrong_timeout_is_a_usage_error_naming_it(
        pytester: pytest.Pytester, bare_env: dict[str, str], use_env: UseEnv,
        args: list[str], ini: str, message: str) -> None:
    use_env(bare_env)
    pytester.makeini(f"[pytest]\n{ini}")
    pytester.makepyfile(test_plain="def test_plain():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args, timeout=60)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}"])
    assert "Traceback" not in result.stderr.str()


# docs/pytest.md's example project, as written there.
DOCS_EXAMPLE = re.search(r"`tests/test_model.py` of a JAX project:\n\n(?:<!--[^\n]*-->\n)?"
                         r"```python\n(.*?)```",
                         (Path(__file__).resolve().parent.parent / "docs" / "pytest.md")
                         .read_text(), re.DOTALL)
FAKE_JAX_PLUGIN = Path(__file__).resolve().parent / "fakes" / "jax_plugin"


# Runs in a row: CI runs 3 (about 20 s each); GPUDIAG_XDIST_RUNS=10 is the figure.
XDIST_RUNS = int(os.environ.get("GPUDIAG_XDIST_RUNS", "3"))


@pytest.mark.timeout(120 + 90 * XDIST_RUNS)
@pytest.mark.parametrize("jax_plugin", [False, True], ids=["no-jax-gpu", "fake-jax-plugin"])
def test_xdist_workers_started_together_all_report_the_same_blocker_run_after_run(
        pytester: pytest.Pytester, gpu_env: EnvFactory, use_env: UseEnv, tmp_path: Path,
        jax_plugin: bool) -> None:
    """Issue 23: four workers asking at the same moment used to find each other's probe
    locks, skip JAX and call it ready. Now every worker gives the lone answer, every run."""
    assert DOCS_EXAMPLE is not None, "docs/pytest.md lost its example project"
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=4, GPUDIAG_LOCK_DIR=str(tmp_path / "locks"))
    if jax_plugin:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAKE_JAX_PLUGIN),
                                                          env.get("PYTHONPATH")]))
        env["FAKE_JAX_PLUGIN"] = "none"
    use_env(env)
    pytester.makepyfile(test_model=DOCS_EXAMPLE.group(1))
    codes: set[str] = set()
    for _ in range(XDIST_RUNS):
        result = pytester.runpytest_subprocess("-n", "4", "-p", "no:cacheprovider", "-rs",
                                               "--gpu-required", timeout=240)
        out = result.stdout.str()
        # The JAX GPU test fails with its blocker (no JAX GPU here); the CPU ones pass.
        result.assert_outcomes(passed=2, failed=1)
        # No worker ran the JAX GPU test as ready (it raised "Backend 'cuda' is not in the
        # list of known backends"), nor set JAX_PLATFORMS=cuda,cpu for the CPU test.
        assert "not in the list of known backends" not in out, out
        assert "JAX_PLATFORMS='cuda" not in out, out
        said = set(re.findall(r"gpu\(n=1, require='jax'\): BLOCKED (\w+)", out))
        assert len(said) == 1, out
        codes |= said
    assert len(codes) == 1 and "devices_busy" not in codes and "backend_unproven" not in codes
ATTRIBUTED_TESTS = """
import os, time
import pytest

def _inject(knobs):
    path = os.environ["FAKE_GPU_STATE_FILE"]
    with open(path + ".tmp", "w") as fh:
        fh.write("".join(f"{k}={v}\\n" for k, v in knobs.items()))
    os.replace(path + ".tmp", path)

@pytest.mark.gpu(n=1)
def test_a_gpu_falls_off_the_bus(gpu_devices):
    _inject({"FAKE_NVML_DEVICE_COUNT": 2, "FAKE_NVML_XIDS": "0:79,1:79"})
    time.sleep(1.5)
    raise AssertionError("CUDA_ERROR_LAUNCH_FAILED")

@pytest.mark.gpu(n=1)
def test_my_own_bug(gpu_devices):
    time.sleep(0.2)
    assert 1 + 1 == 3

@pytest.mark.gpu(n=1)
def test_fine(gpu_devices):
    assert True
"""


def test_a_failed_gpu_test_with_a_hardware_event_says_so_in_its_report_and_junit(
        pytester: pytest.Pytester, gpu_env: EnvFactory, use_env: UseEnv,
        tmp_path: Path) -> None:
    state = tmp_path / "gpu-state"
    state.write_text("FAKE_NVML_DEVICE_COUNT=2\n")
    use_env(gpu_env(FAKE_NVML_DEVICE_COUNT=2, FAKE_GPU_STATE_FILE=str(state),
                    GPUDIAG_LOCK_DIR=str(tmp_path / "locks")))
    pytester.makepyfile(test_attributed=ATTRIBUTED_TESTS)
    junit = tmp_path / "junit.xml"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly",
                                           f"--junitxml={junit}", timeout=180)
    result.assert_outcomes(passed=1, failed=2)
    props = properties(junit)
    assert props["test_a_gpu_falls_off_the_bus"]["gpu_failure_attribution"] == (
        f"hardware rule=hardware_xid xid=79 gpu={gpu_uuid(0)}")
    # The XID came during the first test: the second one's failure is its own.
    assert props["test_my_own_bug"]["gpu_failure_attribution"] == (
        "application rule=exit_without_gpu_event")
    assert "gpu_failure_attribution" not in props["test_fine"]
    result.stdout.fnmatch_lines([
        "*gpudiag: who failed this GPU test*",
        f"gpu_failure_attribution=hardware rule=hardware_xid xid=79 gpu={gpu_uuid(0)}",
        f"  * {gpu_uuid(0)}: XID 79 (GPU has fallen off the bus) (watcher)"])
