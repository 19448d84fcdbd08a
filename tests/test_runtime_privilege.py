"""A runtime's code is no more trusted than a job (issue 48).

A root daemon runs a runtime's children as the runtime's ``user`` (default: nobody, 65534),
and it refuses a runtime whose import path (its interpreter's real ``sys.path``,
``pyvenv.cfg``, every ``.pth`` and the folders it adds, the runtime's ``PYTHONPATH``)
another user may write, naming the folder: at ``--check-config``, at start, and at the next
re-read when it becomes writable while the daemon runs. A second uid
(``setpriv --reuid 65534``) plants a ``.pth``, a ``sitecustomize.py`` and a ``PYTHONPATH``
module into each writable place; the planted code writes its uid to a file: none says 0.
Plain venvs of /usr/bin/python3 (uid 65534 can run them; FIELD-NOTES.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.daemon import Daemon, daemon_toml, metric_samples, wait_for, write_config
from tests.support.host import EnvFactory, run_gpudiag

SYSTEM_PYTHON = Path("/usr/bin/python3")
NOBODY = 65534

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or not SYSTEM_PYTHON.exists(),
    reason="needs root, setpriv and /usr/bin/python3 (a second uid plants code)")


@dataclass
class Place:
    """A runtime whose import path has three places another user might write."""

    base: Path
    python: Path
    site: Path
    shared: Path      # the runtime's PYTHONPATH
    pth_target: Path  # a folder a root-owned .pth adds to the path
    results: Path     # where planted code writes the uid it ran as

    def config(self, tmp_path: Path, user: str | None = None,
               nvml_interval_s: float | None = None) -> Path:
        nvml = {"backends.nvml": {"interval_s": nvml_interval_s}} if nvml_interval_s else {}
        toml = daemon_toml({"backends.jax": {"enabled": True, "interval_s": 600},
                            **nvml}) + (
            f'[runtimes.train]\npython = "{self.python}"\nrequire = "jax:cpu"\n'
            f'env = {{ PYTHONPATH = "{self.shared}" }}\n'
            + (f'user = "{user}"\n' if user else ""))
        return write_config(tmp_path / "d.toml", toml)

    def ran_as(self) -> dict[str, str]:
        return {p.name: p.read_text() for p in self.results.iterdir()}


def _planter(results: Path, what: str, sep: str = "\n") -> str:
    return (f"import os{sep}open({str(results)!r} + '/{what}-' + str(os.getpid()), 'w')"
            ".write(str(os.getuid()))\n")


def _as_nobody(*argv: str) -> None:
    subprocess.run(["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY),
                    "--clear-groups", *argv], check=True, timeout=30)


def _plant(folder: Path, results: Path) -> None:
    """As uid 65534: a .pth, a sitecustomize.py and a jax module in ``folder``."""
    for name, text in (("evil.pth", _planter(results, "pth", sep="; ")),  # one line
                       ("sitecustomize.py", _planter(results, "sitecustomize")),
                       ("jax.py", _planter(results, "module"))):
        _as_nobody(str(SYSTEM_PYTHON), "-I", "-S", "-c",
                   f"open({str(folder / name)!r}, 'w').write({text!r})")


@pytest.fixture
def place() -> Iterator[Place]:
    base = Path(tempfile.mkdtemp(prefix="gpudiag-priv-", dir="/tmp"))
    base.chmod(0o755)
    try:
        subprocess.run([str(SYSTEM_PYTHON), "-m", "venv", "--without-pip", str(base / "venv")],
                       check=True, timeout=120, capture_output=True)
        site = next((base / "venv" / "lib").glob("python3*/site-packages"))
        shared, target, results = base / "shared", base / "pthdir", base / "results"
        for folder in (shared, target, results):
            folder.mkdir(mode=0o755)
        os.chown(results, NOBODY, NOBODY)
        (site / "extra.pth").write_text(f"{target}\n")
        yield Place(base, base / "venv" / "bin" / "python", site, shared, target, results)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("where", ["site", "shared", "pth_target"])
def test_check_config_refuses_a_runtime_whose_import_path_another_user_may_write(
        place: Place, tmp_path: Path, gpu_env: EnvFactory, where: str) -> None:
    folder: Path = getattr(place, where)
    os.chown(folder, NOBODY, NOBODY)
    _plant(folder, place.results)
    done = run_gpudiag(["serve", "--check-config", "--config", str(place.config(tmp_path))],
                       gpu_env())
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{folder} may be written by another user (owner uid {NOBODY}" in done.stderr, \
        done.stderr
    assert "runtimes.train" in done.stderr and "Traceback" not in done.stderr
    assert place.ran_as() == {}, "nothing of the runtime ran to check it"


def test_a_writable_site_packages_is_refused_by_mode_too(place: Place, tmp_path: Path,
                                                          gpu_env: EnvFactory) -> None:
    place.site.chmod(0o777)
    done = run_gpudiag(["serve", "--check-config", "--config", str(place.config(tmp_path))],
                       gpu_env())
    assert done.returncode == 2 and f"{place.site} may be written" in done.stderr, done.stderr


def _said(d: Daemon) -> list[str]:
    out = []
    for line in list(d.lines):
        try:
            out.append(str(json.loads(line).get("msg", "")))
        except ValueError:
            continue
    return out


def _section(d: Daemon) -> dict[str, object]:
    status, record = d.get("/v1/health")
    assert status == 200, record
    runtimes = record["evidence"].get("runtimes") or {}
    entry = runtimes.get("train") or {}
    assert isinstance(entry, dict)
    return entry


def test_a_root_daemon_runs_a_runtimes_children_as_nobody(
        place: Place, tmp_path: Path, gpu_env: EnvFactory) -> None:
    # A root-owned module on the runtime's PYTHONPATH (allowed: only root may write it)
    # says which uid imported it: the runtime's fingerprint reading and its JAX probe.
    (place.shared / "jax.py").write_text(_planter(place.results, "module"))
    d = Daemon(gpu_env(), place.config(tmp_path), tmp_path / "state")
    try:
        d.wait_ready(60)
        found = wait_for(lambda: place.ran_as() or None, 60, 0.25)
        wait_for(lambda: _section(d).get("state") in ("ok", "blocked"), 60, 0.25)
    finally:
        d.stop()
    assert found and set(place.ran_as().values()) == {str(NOBODY)}, place.ran_as()


def test_an_explicit_user_runs_the_children_as_that_uid(
        place: Place, tmp_path: Path, gpu_env: EnvFactory) -> None:
    (place.shared / "jax.py").write_text(_planter(place.results, "module"))
    done = run_gpudiag(["serve", "--check-config", "--config",
                        str(place.config(tmp_path, user="4242"))], gpu_env())
    assert done.returncode == 0, done.stderr
    assert 'user = "4242"' in done.stdout, done.stdout


def test_a_runtime_becoming_writable_while_the_daemon_runs_is_refused_and_nothing_runs_as_root(
        place: Place, tmp_path: Path, gpu_env: EnvFactory) -> None:
    d = Daemon(gpu_env(), place.config(tmp_path, nvml_interval_s=0.5), tmp_path / "state")
    try:
        d.wait_ready(60)
        wait_for(lambda: _section(d).get("state") in ("ok", "blocked"), 60, 0.25)
        for folder in (place.site, place.shared, place.pth_target):
            os.chown(folder, NOBODY, NOBODY)
            _plant(folder, place.results)
        entry = wait_for(lambda: (e := _section(d)).get("state") == "refused" and e, 30, 0.25)
        assert "may be written by another user" in str(entry["refused"]), entry
        assert entry["blockers"] == [] and entry["ready"] is False
        refused = {labels["runtime"]: v for labels, v in
                   metric_samples(d, "gpudiag_runtime_refused")}
        assert refused == {"train": 1.0}
        assert any(m.startswith("runtime train refused, its proofs dropped: ")
                   for m in _said(d)), _said(d)[-20:]
        # Asked to prove it now, the daemon still runs nothing of it.
        d.get("/v1/health?max_age_s=0&wait_s=5")
    finally:
        d.stop()
    ran = place.ran_as()
    assert "0" not in ran.values(), ran
    assert set(ran.values()) <= {str(NOBODY)}, ran
