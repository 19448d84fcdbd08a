"""Fingerprints of a job's environment and the [runtimes.NAME] config (issue 37), in-process.

The end-to-end side (real daemons, venvs, hybrid answers, proof on change) is
tests/test_runtimes.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from gpudiag.core import registry
from gpudiag.core.fingerprint_inputs import BUILT_IN, DEVICE_LAYER, backend_names
from gpudiag.daemon.config import ConfigError, from_mapping
from gpudiag.engine.fingerprint import fingerprints
from tests.support.daemon import write_config
from tests.support.host import EnvFactory, run_gpudiag


def _ids(env: dict[str, str]) -> dict[str, str]:
    found = fingerprints(BUILT_IN, env)["backends"]
    return {name: entry["id"] for name, entry in found.items()}


# --- fingerprints -------------------------------------------------------------------------


def test_a_backends_variable_changes_its_fingerprint_and_no_other() -> None:
    base = {"PATH": "/usr/bin"}
    plain, cpu = _ids(base), _ids({**base, "JAX_PLATFORMS": "cpu"})
    assert plain["jax"] != cpu["jax"]
    assert plain["iree"] == cpu["iree"]
    assert _ids(dict(base)) == plain  # the same environment, the same ids
    # The visibility variables travel on their own: they change no fingerprint.
    assert _ids({**base, "CUDA_VISIBLE_DEVICES": "0"}) == plain


def test_a_secret_looking_variable_counts_as_set_never_by_its_value() -> None:
    one = fingerprints(BUILT_IN, {"XLA_TOKEN": "s3cr3t-one"})
    two = fingerprints(BUILT_IN, {"XLA_TOKEN": "s3cr3t-two"})
    assert one["backends"]["jax"]["id"] == two["backends"]["jax"]["id"]
    assert "s3cr3t" not in json.dumps(one)


def test_the_fast_paths_declarations_are_the_specs_own() -> None:
    for name, decl in BUILT_IN.items():
        spec = registry.spec(name)
        assert spec is not None and spec.environment is decl, name
    declared = {s.name for s in registry.specs() if s.environment is not None}
    assert declared == set(BUILT_IN)


def test_the_device_layer_is_named_once_the_registrys_word() -> None:
    """The fast path's plain-data device layer is exactly the registry's built-in backends
    proven on the node (no environment declared), and its job-environment ones are BUILT_IN."""
    node = {s.name for s in registry.specs() if not registry.environment_dependent(s.name)}
    job = {s.name for s in registry.specs() if registry.environment_dependent(s.name)}
    assert DEVICE_LAYER == node
    assert set(BUILT_IN) == job
    assert backend_names("jax:cpu, CUDA,,iree") == {"jax", "cuda", "iree"}


def test_installed_backends_are_read_from_the_folders_without_importing(tmp_path: Path
                                                                       ) -> None:
    site = tmp_path / "site"
    (site / "jax-0.10.2.dist-info").mkdir(parents=True)
    (site / "jax-0.10.2.dist-info" / "METADATA").write_text("Name: jax\n")
    found = fingerprints(BUILT_IN, {}, paths=[str(site)])
    assert found["backends"]["jax"]["installed"] is True
    assert found["backends"]["jax"]["distributions"] == {"jax": "0.10.2"}
    assert found["backends"]["iree"]["installed"] is False
    before = found["backends"]["jax"]["id"]
    (site / "jax_cuda12_plugin-0.10.2.dist-info").mkdir()
    after = fingerprints(BUILT_IN, {}, paths=[str(site)])["backends"]["jax"]["id"]
    assert after != before, "a plugin installed beside JAX must change its fingerprint"


# --- config -------------------------------------------------------------------------------


@pytest.mark.parametrize(("table", "key"), [
    ({"python": "/nonexistent/bin/python"}, "runtimes.venv.python"),
    ({"python": "bin/python"}, "runtimes.venv.python"),
    ({"python": sys.executable, "env": {"CUDA_VISIBLE_DEVICES": "0"}}, "runtimes.venv.env"),
    ({"python": sys.executable, "require": "cuda"}, "runtimes.venv.require"),
    ({"python": sys.executable, "colour": "red"}, "runtimes.venv.colour"),
])
def test_a_bad_runtime_is_refused_naming_its_key(table: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        from_mapping({"runtimes": {"venv": table}})


def test_an_interpreter_in_a_folder_others_can_write_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o777)
    python = folder / "python"
    python.symlink_to(sys.executable)
    with pytest.raises(ConfigError, match="may be written by another user"):
        from_mapping({"runtimes": {"venv": {"python": str(python)}}})


def test_the_daemons_own_runtime_takes_only_require() -> None:
    cfg = from_mapping({"runtimes": {"gpudiag": {"require": "jax"}}})
    assert [(r.name, r.require) for r in cfg.runtimes] == [("gpudiag", ("jax",))]
    with pytest.raises(ConfigError, match="only its require"):
        from_mapping({"runtimes": {"gpudiag": {"python": sys.executable}}})


def test_check_config_refuses_a_missing_interpreter_with_exit_2(tmp_path: Path,
                                                               gpu_env: EnvFactory) -> None:
    config = write_config(tmp_path / "d.toml", '[runtimes.train]\npython = "/no/such/python"\n')
    done = run_gpudiag(["serve", "--check-config", "--config", str(config)], gpu_env())
    assert done.returncode == 2, done.stderr
    assert "runtimes.train.python" in done.stderr and "Traceback" not in done.stderr


def test_admission_proves_again_under_its_lock_when_the_runtimes_proof_is_old() -> None:
    from gpudiag.core.clock import rfc3339
    from gpudiag.core.requirement import parse_requirement
    from gpudiag.core.verdict import BackendStatus, DeviceInfo, Verdict
    from gpudiag.runner.admission import proven_on

    uuid = "GPU-f00d0000-0000-4000-8000-000000000000"
    now = 1_800_000_000.0

    def verdict(proven_at: float) -> Verdict:
        device = DeviceInfo(0, uuid, "H200", None, 1, 1, last_proven_at=rfc3339(now - 1))
        return Verdict(
            requirement=parse_requirement("cuda,jax"), blockers=(), warnings=(),
            devices=(device,), backends={
                "cuda": BackendStatus("ok", 0.1), "jax": BackendStatus(
                    "ok", 1.0, detail={"proven_on": uuid})},
            evidence={"proof": {"jax": {"where": "daemon", "runtime": "train",
                                        "proven_at": rfc3339(proven_at)}}},
            preallocation_disabled=True, host="n1", checked_at=rfc3339(now), source="daemon")

    assert proven_on(verdict(now - 10), [uuid], now_wall=now)
    # An hour-old proof of the job's runtime stands for nothing under the lock.
    assert not proven_on(verdict(now - 3000), [uuid], now_wall=now)


def test_a_daemon_answer_proven_in_another_environment_does_not_hold() -> None:
    from gpudiag.core.requirement import parse_requirement
    from gpudiag.core.verdict import BackendStatus, Verdict
    from gpudiag.engine.client import question_of

    def record(proof: dict[str, Any]) -> dict[str, Any]:
        return Verdict(
            requirement=parse_requirement("jax:cpu"), blockers=(), warnings=(), devices=(),
            backends={"jax": BackendStatus("ok", 1.0)}, evidence={"proof": proof},
            preallocation_disabled=True, host="n1", checked_at="2026-12-02T00:00:00.000Z",
            source="daemon").record()

    from gpudiag.engine.answercheck import check_answer

    asked = question_of(parse_requirement("jax:cpu"), "jax:" + "a" * 16)
    mine = {"jax": {"where": "daemon", "runtime": "train", "fingerprint": "a" * 16}}
    other = {"jax": {"where": "daemon", "runtime": "train", "fingerprint": "b" * 16}}
    assert check_answer(record(mine), asked) is None
    problem = check_answer(record(other), asked)
    assert problem is not None and "another environment" in problem
    assert "says nothing of where jax" in str(check_answer(record({}), asked))
