"""Shared fixtures (the fake driver, hosts) and the tiers; the helpers are in tests/support/."""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from tests.fakes.build import FakeDriver, build_fakes
from tests.support.host import (
    SESSION_LOCKS,
    EnvFactory,
    bare_host_env,
    clean_env,
    make_host_dirs,
)


@pytest.fixture(scope="session", autouse=True)
def _session_locks() -> Iterator[None]:
    yield
    shutil.rmtree(SESSION_LOCKS, ignore_errors=True)


@pytest.fixture(scope="session")
def fakes(tmp_path_factory: pytest.TempPathFactory) -> FakeDriver:
    """The fake libnvidia-ml, libcuda and nvidia-smi, built once per test session."""
    return build_fakes(tmp_path_factory.mktemp("fakes"))


@pytest.fixture
def gpu_env(fakes: FakeDriver, tmp_path: Path) -> EnvFactory:
    """``gpu_env(**knobs)``: an environment of a host with the fakes and healthy nodes."""
    dev, proc = make_host_dirs(tmp_path / "host")

    def make(base: Mapping[str, str] | None = None, **knobs: str | int) -> dict[str, str]:
        env = clean_env() if base is None else dict(base)
        env.setdefault("GPUDIAG_DEVICE_DIR", str(dev))
        env.setdefault("GPUDIAG_DRIVER_PROC_DIR", str(proc))
        return fakes.env(base=env, **knobs)

    return make


@pytest.fixture
def bare_env(tmp_path: Path) -> dict[str, str]:
    """A GPU-less host: no driver libraries, no nodes, no kernel module (like this machine)."""
    return bare_host_env(tmp_path / "bare")


# The `slow` tier: `pytest -m "not slow"` is the developer's inner loop, CI (.ci/run) runs
# every tier. Whole modules that run real infrastructure or real backends, and single tests
# that took seconds on the 2-core dev VM (`--durations`, docs/testing.md "Tiers"); a test may
# also mark itself with @pytest.mark.slow. tests/test_tiers.py checks every name here exists.
SLOW_MODULES = {
    "test_crash_safety": "kills writers and `gpudiag run` at random points, many rounds",
    "test_daemon_integration": "several real daemons through whole probe rounds",
    "test_fault_matrix": "every catalog code through a real daemon, the CLI and the history",
    "test_fleet": "a real Prometheus scraping real daemons",
    "test_gpu_validate": "scripts/gpu-validate.sh end to end",
    "test_grafana": "a real Prometheus and daemons behind every dashboard query",
    "test_host_faults_daemon": "real daemons on full disks and damaged state folders",
    "test_http_abuse": "1000 stalled connections, deadlines of seconds",
    "test_iree": "real IREE compiles and runs kernels in probe children",
    "test_jax": "real JAX in probe children (0.5-3 s each)",
    "test_pytest_plugin": "pytest sessions in children, xdist workers, real JAX on the CPU",
    "test_real_jax": "the real JAX CUDA stack (a 3.2 GB install on first use)",
    "test_run": "`gpudiag run` end to end with probes and launches",
    "test_slurm": "a real Slurm cluster (munged, slurmctld, slurmd)",
    "test_soak": "a daemon under flapping faults for 45 s",
}
SLOW_TESTS = {
    "test_store": ("test_sigkill_while_the_daemon_writes_200_times_loses_no_acknowledged_verdict",
                   "test_retention_by_size_bounds_the_file"),
    "test_properties": ("test_classify_never_raises_on_mutated_real_observations",
                        "test_real_observations_have_the_shape_classify_reads",
                        "test_from_record_gives_a_verdict_or_a_record_error",
                        "test_jax_error_texts_classify_without_raising",
                        "test_watcher_lines_never_break_the_supervisor_or_the_exporter",
                        "test_driver_causes_from_jax_texts_are_cuda_layer_codes",
                        "test_any_config_mapping_is_a_config_or_a_config_error"),
    "test_ux": ("test_every_try_without_a_gpu_recipe_runs_as_written",
                "test_probe_and_preflight_list_backends_in_one_order",
                "test_daemon_and_preflight_text_show_source_and_age",
                "test_the_daemon_says_what_changed_in_its_verdict"),
    "test_busy_node": ("test_daemon_rounds_while_jobs_come_and_go_never_touch_a_busy_gpu",),
    "test_probe_engine": ("test_no_secret_reaches_any_output",),
    "test_render": ("test_jax_probe_reports_leaked_preallocation_but_never_uses_it",),
    "test_nfd": ("test_a_real_daemon_keeps_the_file_current_as_a_gpu_is_lost_and_repaired",),
    "test_admission": ("test_a_waiting_admission_gets_the_gpu_when_its_holder_ends",
                       "test_a_waiting_admission_notices_a_busy_gpu_becoming_free",
                       "test_nothing_to_admit_for_zero_gpus",
                       "test_a_gpu_whose_holder_was_sigkilled_is_admitted_again",
                       "test_visibility_narrows_and_never_widens",
                       "test_a_change_before_the_locked_observation_aborts"),
    "test_daemon_scheduler": ("test_a_silent_watcher_is_killed_and_restarted",
                              "test_the_loop_sends_keepalives_and_stops_when_wedged"),
    "test_systemd": ("test_gpudiag_serve_notifies_ready_then_keepalives_that_stop_when_frozen",
                     "test_wedged_scheduler_loop_stops_the_watchdog_keepalive",
                     "test_gpudiag_serve_under_systemd_serves_its_runtime_directory_socket"),
    "test_fakes": ("test_iree_healthy", "test_iree_errors",
                   "test_iree_is_refused_only_on_the_busy_exclusive_gpu"),
    "test_clear": ("test_clear_releases_held_xids_and_a_gpu_that_still_fails_is_blocked_again",),
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests of SLOW_MODULES and SLOW_TESTS slow."""
    for item in items:
        module = item.path.stem
        function = getattr(item, "originalname", item.name)
        if module in SLOW_MODULES or function in SLOW_TESTS.get(module, ()):
            item.add_marker(pytest.mark.slow)
