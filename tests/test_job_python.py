"""The job's own interpreter decides the answer (issue 48): found, never assumed to be gpudiag's.

The node install layout: gpudiag in a venv of its own (with JAX, and without: an install
without extras), called by jobs whose venvs have JAX or not, found through ``--python``,
``$GPUDIAG_JOB_PYTHON``, ``VIRTUAL_ENV`` and ``PATH`` as ``activate`` leaves them, or ARGV's
own Python for ``gpudiag run``. Every answer must be what the job's interpreter says of
itself with ``--no-daemon``, and none may name gpudiag's own interpreter for a job. Real
venvs (tests/support/venvs.py), real JAX on the CPU, the fake driver, real daemons.
"""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpudiag.core.fingerprint_inputs import BUILT_IN
from gpudiag.engine import jobpython
from tests.support.daemon import Daemon, daemon_toml, write_config
from tests.support.host import EnvFactory
from tests.support.venvs import install_fake_distribution, make_venv

pytestmark = pytest.mark.slow


def _job_env(base: dict[str, str], **extra: str) -> dict[str, str]:
    """``base`` without the suite's default job interpreter (tests/conftest.py)."""
    env = {k: v for k, v in base.items() if k != "GPUDIAG_JOB_PYTHON"}
    env.update(extra)
    return env


def _activated(env: dict[str, str], python: Path) -> dict[str, str]:
    """``env`` as the venv's ``bin/activate`` leaves it: VIRTUAL_ENV and PATH."""
    venv = python.parent.parent
    return {**env, "VIRTUAL_ENV": str(venv),
            "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"}


def _gpudiag(node: Path, args: list[str], env: dict[str, str], timeout: float = 120
             ) -> tuple[int, dict[str, Any], str]:
    """The node's gpudiag (``node``: its venv's python) with ``--format json``."""
    done = subprocess.run([str(node), "-m", "gpudiag", *args, "--format", "json"],
                          env=env, capture_output=True, text=True, timeout=timeout, check=False)
    try:
        return done.returncode, json.loads(done.stdout), done.stderr
    except ValueError:
        raise AssertionError(f"no record: rc={done.returncode}\n{done.stderr}") from None


def _own_answer(job: Path, args: list[str], env: dict[str, str]) -> tuple[int, str]:
    """What the job's interpreter says of itself: gpudiag run by it, no daemon."""
    code, record, _ = _gpudiag(job, [*args, "--no-daemon"], {**env,
                                                             "GPUDIAG_JOB_PYTHON": str(job)})
    return code, record["gpu_validation_blocker"]


@pytest.fixture(scope="module")
def venvs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Node installs (gpudiag with JAX: this suite's venv; without: no extras) and jobs."""
    root = tmp_path_factory.mktemp("venvs")
    return {"node_jax": Path(sys.executable),
            "node_plain": make_venv(root / "node-plain", with_jax=False),
            "job_jax": make_venv(root / "job-jax", with_jax=True),
            "job_plain": make_venv(root / "job-plain", with_jax=False)}


@pytest.fixture
def daemon(tmp_path: Path, gpu_env: EnvFactory) -> Iterator[Daemon]:
    toml = daemon_toml({"backends.jax": {"enabled": True, "interval_s": 600}})
    d = Daemon(gpu_env(), write_config(tmp_path / "daemon.toml", toml), tmp_path / "state")
    d.wait_ready(60)
    yield d
    d.stop()


@pytest.mark.parametrize("node", ["node_jax", "node_plain"])
@pytest.mark.parametrize("job", ["job_jax", "job_plain"])
@pytest.mark.parametrize("chosen_by", ["VIRTUAL_ENV", "PATH", "--python", "GPUDIAG_JOB_PYTHON"])
def test_every_answer_is_the_job_interpreters_own(
        node: str, job: str, chosen_by: str, venvs: dict[str, Path],
        gpu_env: EnvFactory) -> None:
    env = _job_env(gpu_env())
    python = venvs[job]
    args = ["preflight", "--require", "jax:cpu"]
    if chosen_by == "VIRTUAL_ENV":
        env = _activated(env, python)
    elif chosen_by == "PATH":  # a venv put first on PATH without activate
        env["PATH"] = f"{python.parent}{os.pathsep}/usr/bin:/bin"
    elif chosen_by == "--python":
        args += ["--python", str(python)]
    else:
        env["GPUDIAG_JOB_PYTHON"] = str(python)
    want = _own_answer(python, ["preflight", "--require", "jax:cpu"], _job_env(gpu_env()))
    assert want == ((0, "none") if job == "job_jax" else (1, "jax_not_installed"))
    code, record, err = _gpudiag(venvs[node], [*args, "--no-daemon"], env)
    assert (code, record["gpu_validation_blocker"]) == want, err
    where = record["evidence"]["job_python"]
    assert Path(where["path"]).parent == python.parent, where
    assert where["chosen_by"] == ("PATH" if chosen_by == "PATH" else chosen_by)


@pytest.mark.parametrize("job", ["job_jax", "job_plain"])
def test_a_daemon_answered_job_gets_its_own_interpreters_answer(
        job: str, venvs: dict[str, Path], daemon: Daemon, gpu_env: EnvFactory) -> None:
    """The round-4 defect: a job without JAX was told ready from the daemon's own JAX."""
    python = venvs[job]
    env = _activated(_job_env(gpu_env()), python)
    want = _own_answer(python, ["preflight", "--require", "jax:cpu"], _job_env(gpu_env()))
    for node in ("node_jax", "node_plain"):
        code, record, err = _gpudiag(venvs[node], ["preflight", "--require", "jax:cpu",
                                                   "--daemon-url", daemon.url], env)
        assert (code, record["gpu_validation_blocker"]) == want, (node, err)
        assert record["source"] == "hybrid", record["source"]  # not the daemon's own proof
        proof = record["evidence"]["proof"]["jax"]
        assert proof["where"] == "here" and proof["interpreter"] == str(python)
        assert record["evidence"]["job_python"] == {"path": str(python),
                                                    "chosen_by": "VIRTUAL_ENV"}


def test_the_daemons_own_venv_as_the_job_is_answered_from_its_proof(
        venvs: dict[str, Path], daemon: Daemon, gpu_env: EnvFactory) -> None:
    env = _activated(_job_env(gpu_env()), venvs["node_jax"])
    code, record, err = _gpudiag(venvs["node_plain"], ["preflight", "--require", "jax:cpu",
                                                       "--daemon-url", daemon.url], env)
    assert record["source"] == "daemon", err
    assert record["evidence"]["proof"]["jax"]["runtime"] == "gpudiag"
    assert record["evidence"]["job_python"]["chosen_by"] == "VIRTUAL_ENV"


@pytest.mark.parametrize("how", ["argv0", "shebang", "env_shebang"])
@pytest.mark.parametrize("job", ["job_jax", "job_plain"])
def test_gpudiag_run_proves_under_the_commands_own_python(
        how: str, job: str, venvs: dict[str, Path], gpu_env: EnvFactory,
        tmp_path: Path) -> None:
    python = venvs[job]
    # The job's PATH leads elsewhere (the other venv): ARGV's own Python decides.
    other = venvs["job_plain" if job == "job_jax" else "job_jax"]
    env = _job_env(gpu_env(), PATH=f"{other.parent}{os.pathsep}/usr/bin:/bin",
                   GPUDIAG_DAEMON_URL="http://127.0.0.1:1")
    script = tmp_path / "train.py"
    if how == "argv0":
        argv = [str(python), "-c", "pass"]
    else:
        head = f"#!{python}" if how == "shebang" else "#!/usr/bin/env python3"
        script.write_text(f"{head}\nprint('trained')\n")
        script.chmod(0o755)
        argv = [str(script)]
        if how == "env_shebang":
            env["PATH"] = f"{python.parent}{os.pathsep}/usr/bin:/bin"
    done = subprocess.run([str(venvs["node_jax"]), "-m", "gpudiag", "run", "--require",
                           "jax:cpu", "--artifacts", str(tmp_path / "runs"), "--", *argv],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    closeout = json.loads(next((tmp_path / "runs").rglob("closeout.json")).read_text())
    if job == "job_jax":
        assert done.returncode == 0, done.stderr
        assert closeout["gpu_validation_blocker"] == "none"
    else:
        assert done.returncode == 125, done.stderr
        assert closeout["gpu_validation_blocker"] == "jax_not_installed"


@pytest.mark.parametrize("node", ["node_jax", "node_plain"])
def test_probe_says_not_checked_for_what_the_jobs_environment_lacks(
        node: str, venvs: dict[str, Path], gpu_env: EnvFactory) -> None:
    env = _activated(_job_env(gpu_env()), venvs["job_plain"])
    code, record, err = _gpudiag(venvs[node], ["probe"], env)
    assert code == 0, err
    assert record["gpu_validation_blocker"] == "none"
    skipped = {w["backend"] for w in record["warnings"] if w["code"] == "backend_not_checked"}
    assert skipped == {"jax", "iree"}
    assert all(str(venvs["job_plain"]) in w["message"] for w in record["warnings"]
               if w["code"] == "backend_not_checked")
    # Asked for by name it is required: the job's environment lacks it.
    code, record, _ = _gpudiag(venvs[node], ["probe", "--backend", "host,nvml,jax:cpu"], env)
    assert (code, record["gpu_validation_blocker"]) == (1, "jax_not_installed")


def test_probe_from_a_node_install_without_jax_proves_the_jobs_jax(
        venvs: dict[str, Path], gpu_env: EnvFactory) -> None:
    env = _activated(_job_env(gpu_env()), venvs["job_jax"])
    code, record, err = _gpudiag(venvs["node_plain"], ["probe", "--backend", "nvml,jax:cpu"],
                                 env)
    assert (code, record["gpu_validation_blocker"]) == (0, "none"), err
    assert record["backends"]["jax"]["status"] == "ok"


@pytest.mark.parametrize("bad", ["/nonexistent/bin/python", "/bin/ls", "/etc/hostname"])
def test_a_python_that_is_not_one_is_a_usage_error_naming_it(
        bad: str, venvs: dict[str, Path], gpu_env: EnvFactory) -> None:
    env = _job_env(gpu_env())
    for args in (["preflight", "--require", "jax", "--python", bad],
                 ["probe", "--python", bad], ["fingerprint", "--python", bad]):
        done = subprocess.run([sys.executable, "-m", "gpudiag", *args], env=env,
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 2, (args, done.stderr)
        assert bad in done.stderr and "Traceback" not in done.stderr
    env["GPUDIAG_JOB_PYTHON"] = bad
    done = subprocess.run([sys.executable, "-m", "gpudiag", "preflight", "--require", "jax"],
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "GPUDIAG_JOB_PYTHON" in done.stderr, done.stderr


def _fake_python(folder: Path, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "python3"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def test_a_job_interpreter_that_hangs_times_out_and_is_never_replaced_by_gpudiags(
        gpu_env: EnvFactory, tmp_path: Path) -> None:
    hung = _fake_python(tmp_path / "hung" / "bin", "exec sleep 60")
    env = _job_env(gpu_env())
    started = time.monotonic()
    code, record, err = _gpudiag(Path(sys.executable),
                                 ["preflight", "--require", "jax:cpu", "--no-daemon",
                                  "--python", str(hung), "--timeout", "3"], env)
    assert time.monotonic() - started < 30
    assert (code, record["gpu_validation_blocker"]) == (1, "probe_timeout"), err
    assert record["evidence"]["job_python"]["path"] == str(hung)


def test_a_job_interpreter_that_crashes_is_a_crash_verdict_and_fingerprint_exits_3(
        gpu_env: EnvFactory, tmp_path: Path) -> None:
    crashing = _fake_python(tmp_path / "crash" / "bin", "kill -SEGV $$")
    env = _job_env(gpu_env())
    code, record, err = _gpudiag(Path(sys.executable),
                                 ["preflight", "--require", "jax:cpu", "--no-daemon",
                                  "--python", str(crashing)], env)
    assert (code, record["gpu_validation_blocker"]) == (1, "probe_crashed"), err
    done = subprocess.run([sys.executable, "-m", "gpudiag", "fingerprint", "--python",
                           str(crashing)], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 3 and "gave no fingerprint" in done.stderr, done.stderr


def test_preallocation_is_the_jobs_on_every_path(
        venvs: dict[str, Path], daemon: Daemon, gpu_env: EnvFactory) -> None:
    for value, want in ((None, "yes"), ("true", "no")):
        env = _activated(_job_env(gpu_env()), venvs["job_jax"])
        if value is not None:
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = value
        seen = set()
        for where in (["--no-daemon"], ["--daemon-url", daemon.url]):
            for require in ("jax:cpu", "cuda"):
                _, record, err = _gpudiag(venvs["node_jax"],
                                          ["preflight", "--require", require, *where], env)
                seen.add(record["preallocation_disabled"])
        assert seen == {want}, (value, seen)


def test_the_fingerprint_is_read_by_the_job_interpreter_once_per_change(
        venvs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    job = make_venv(tmp_path / "job", with_jax=False)
    python = jobpython.JobPython(str(job), "--python")
    env = {"PATH": "/usr/bin:/bin"}
    asked: list[int] = []
    real_ask = jobpython._ask

    def counting(*args: Any, **kwargs: Any) -> dict[str, Any]:
        asked.append(1)
        return real_ask(*args, **kwargs)

    monkeypatch.setattr(jobpython, "_ask", counting)
    first = jobpython.fingerprints(BUILT_IN, env, python)
    assert first["interpreter"]["prefix"] == str(job.parent.parent.resolve())
    assert not first["backends"]["jax"]["installed"]
    again = jobpython.fingerprints(BUILT_IN, env, python)
    assert again == first and len(asked) == 1  # the cache answered
    install_fake_distribution(job, "jax", "0.10.2")
    changed = jobpython.fingerprints(BUILT_IN, env, python)
    assert len(asked) == 2 and changed["backends"]["jax"]["installed"]
    assert changed["backends"]["jax"]["id"] != first["backends"]["jax"]["id"]
    own = jobpython.fingerprints(BUILT_IN, env, jobpython.this_process())
    assert len(asked) == 2  # this interpreter reads itself in this process
    assert own["backends"]["jax"]["id"] != first["backends"]["jax"]["id"]


def test_a_cache_folder_another_user_could_write_is_never_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = tmp_path / "shared"
    (shared / "gpudiag").mkdir(parents=True)
    (shared / "gpudiag").chmod(0o777)
    monkeypatch.setenv("XDG_CACHE_HOME", str(shared))
    assert jobpython.cache_dir() is None
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "private"))
    folder = jobpython.cache_dir()
    assert folder is not None and (os.stat(folder).st_mode & 0o777) == 0o700


def test_the_job_interpreter_is_found_in_the_documented_order(tmp_path: Path) -> None:
    venv = make_venv(tmp_path / "venv", with_jax=False)
    conda = make_venv(tmp_path / "conda", with_jax=False)
    path_python = _fake_python(tmp_path / "onpath", "exit 0")
    base = {"PATH": f"{path_python.parent}{os.pathsep}/usr/bin"}
    find = jobpython.find
    assert find(base).record() == {"path": str(path_python), "chosen_by": "PATH"}
    assert find({**base, "CONDA_PREFIX": str(conda.parent.parent)}).chosen_by == "CONDA_PREFIX"
    both = {**base, "CONDA_PREFIX": str(conda.parent.parent),
            "VIRTUAL_ENV": str(venv.parent.parent)}
    assert find(both).record() == {"path": str(venv), "chosen_by": "VIRTUAL_ENV"}
    assert find(both, inside_job=True).chosen_by == "sys.executable"
    assert find(both, command=[str(conda), "x.py"]).record() == {"path": str(conda),
                                                                 "chosen_by": "command"}
    assert find(both, command=["bash", "x.sh"]).chosen_by == "VIRTUAL_ENV"  # not a Python
    named = {**both, "GPUDIAG_JOB_PYTHON": str(conda)}
    assert find(named, command=[str(venv)]).chosen_by == "GPUDIAG_JOB_PYTHON"
    assert find(named, explicit=str(venv)).record() == {"path": str(venv),
                                                        "chosen_by": "--python"}
    assert find({"PATH": str(tmp_path / "nowhere")}).record() == {"path": None,
                                                                   "chosen_by": "none"}
    assert jobpython.JobPython(sys.executable, "sys.executable").own
    assert not jobpython.JobPython(str(venv), "VIRTUAL_ENV").own  # same binary, other venv


def test_a_job_without_any_python_reads_not_installed_never_gpudiags(
        gpu_env: EnvFactory, tmp_path: Path) -> None:
    """No --python, no venv, no python3 on PATH (a Slurm Prolog's empty environment)."""
    env = _job_env(gpu_env(), PATH=str(tmp_path / "nowhere"))
    env.pop("VIRTUAL_ENV", None)
    env.pop("CONDA_PREFIX", None)
    code, record, err = _gpudiag(Path(sys.executable),
                                 ["preflight", "--require", "jax:cpu", "--no-daemon"], env)
    assert (code, record["gpu_validation_blocker"]) == (1, "jax_not_installed"), err
    assert record["evidence"]["job_python"] == {"path": None, "chosen_by": "none"}


def _without_jax(folder: Path) -> Path:
    """A folder of links to this suite's site-packages without JAX and IREE (pytest, the
    plugin's entry point and the rest stay importable)."""
    from tests.support.venvs import own_site_packages

    folder.mkdir()
    for entry in own_site_packages().iterdir():
        if not entry.name.lower().startswith(("jax", "_jax", "iree")):
            (folder / entry.name).symlink_to(entry)
    return folder


@pytest.mark.parametrize("job", ["job_jax", "job_plain"])
def test_the_pytest_plugin_in_the_job_venv_proves_that_venv(
        job: str, venvs: dict[str, Path], daemon: Daemon, gpu_env: EnvFactory,
        tmp_path: Path) -> None:
    """The plugin runs inside the job: its own interpreter is the job's, whatever VIRTUAL_ENV
    says (here the other venv, as a stale activation would leave it)."""
    python = venvs[job]
    other = venvs["job_plain" if job == "job_jax" else "job_jax"]
    (tmp_path / "test_model.py").write_text(
        "import pytest\n\n@pytest.mark.gpu(require='jax')\ndef test_on_gpu():\n    pass\n")
    env = _activated(_job_env(gpu_env()), other)
    env.update(GPUDIAG_DAEMON_URL=daemon.url, GPUDIAG_LOCK_DIR=str(tmp_path / "locks"))
    if job == "job_plain":  # pytest and the plugin importable, JAX and IREE not
        env["PYTHONPATH"] = str(_without_jax(tmp_path / "no-jax"))
    done = subprocess.run([str(python), "-m", "pytest", "-p", "no:cacheprovider", "-rs", "-q",
                           str(tmp_path / "test_model.py")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          check=False)
    out = done.stdout + done.stderr
    assert "1 skipped" in done.stdout, out  # a GPU JAX on the fakes: never a pass here
    if job == "job_jax":  # its JAX (CPU-only) is found: no GPU platform, not "not installed"
        assert "jax_gpu_backend_absent" in out and "jax_not_installed" not in out, out
    else:
        assert "jax_not_installed" in out and "1 skipped" in done.stdout, out


def test_without_a_private_cache_the_archive_goes_to_one_private_folder_per_user(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    first = jobpython.probe_archive(None)
    assert Path(first).parent == tmp_path / f"gpudiag-probes-{os.geteuid()}"
    assert jobpython.probe_archive(None) == first  # the same folder, the same archive
    os.chmod(Path(first).parent, 0o777)  # a folder others may write is never used
    assert Path(jobpython.probe_archive(None)).parent != Path(first).parent


def test_a_job_interpreters_probes_never_touch_a_gpu_another_job_uses(
        venvs: dict[str, Path], gpu_env: EnvFactory, tmp_path: Path) -> None:
    """JAX and IREE run under the job's interpreter through the same busy-GPU round: on a
    node whose GPU 0 another job uses, no context is made there (the fake driver's log)."""
    from tests.fakes.jobs import FakeJobs, read_context_log

    log = tmp_path / "contexts.jsonl"
    with FakeJobs(tmp_path / "state") as jobs:
        env = _job_env(gpu_env(FAKE_NVML_DEVICE_COUNT=2, FAKE_GPU_STATE_FILE=str(jobs.state_file),
                               FAKE_CUDA_CONTEXT_LOG=str(log)))
        env["GPUDIAG_LOCK_DIR"] = str(tmp_path / "locks")
        jobs.start(0, memory_mib=100_000)
        code, record, err = _gpudiag(Path(sys.executable),
                                     ["preflight", "--require", "cuda,iree", "--gpus", "1",
                                      "--no-daemon", "--python", str(venvs["job_jax"])], env)
        contexts = read_context_log(log, event="context")
        busy = record["devices"][0]["uuid"]
        assert record["devices"][0]["occupancy"] == "busy", err
        assert [c for c in contexts if c.uuid == busy] == [], "a probe touched the busy GPU"
        assert jobs.contexts_while_busy(read_context_log(log)) == []
        assert record["evidence"]["job_python"]["path"] == str(venvs["job_jax"])
        # The free GPU was touched by two processes: the cuda probe and IREE's device made in
        # the job's interpreter (on the fakes its kernel then fails: iree_execute_failed).
        assert len({c.pid for c in contexts if c.uuid != busy}) >= 2, contexts


_NAME_TEXT = st.text(alphabet="AJXB_*?[]!x", max_size=8)


@given(name=_NAME_TEXT, pattern=_NAME_TEXT)
def test_the_cache_keys_variable_match_is_fnmatchs(name: str, pattern: str) -> None:
    assert jobpython.name_matches(name, pattern) == fnmatch.fnmatchcase(name, pattern)


def test_the_cache_key_follows_every_declared_variable() -> None:
    decls = dict(BUILT_IN)
    env = {"JAX_PLATFORMS": "cpu", "LD_LIBRARY_PATH": "/x", "IREE_X": "1", "HOME": "/h",
           "JAXNOT": "1", "UNRELATED": "1", "XLA_FLAGS": "--f"}
    assert jobpython._relevant(decls, env) == {
        k: env[k] for k in ("HOME", "IREE_X", "JAX_PLATFORMS", "LD_LIBRARY_PATH", "XLA_FLAGS")}

