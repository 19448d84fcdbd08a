"""Shared fixtures (the fake driver, hosts) and the tiers; the helpers are in tests/support/."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Mapping
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
from tests.support.survivors import SESSION_MARK, kill, mark_session, survivors

# A suite started in the background by a shell without job control (`pytest ... &`, a CI
# step, nohup) inherits SIGINT ignored, and an ignored signal stays ignored across exec: every
# CLI the tests start would ignore the Ctrl-C they send it (test_watch, test_cli_entry), and
# Python installs no KeyboardInterrupt handler over an inherited SIG_IGN. Python's own
# handler is reset to the default at exec, so the children get Ctrl-C as a person's would.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# The job's interpreter (gpudiag/engine/jobpython.py) is this one unless a test says
# otherwise: the suite's CLI calls are the job of the venv they run in. Tests of how the job's
# interpreter is found (tests/test_job_python.py) remove the variable from their children's
# environments.
os.environ.setdefault("GPUDIAG_JOB_PYTHON", sys.executable)


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
    "test_runtimes": "real daemons proving real venvs' JAX, and jobs asking them",
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
    "test_remediation_slurm": "a real Slurm cluster and real daemons draining it",
    "test_soak": "a daemon under flapping faults for 45 s",
    "test_runtime_alerts": "a real daemon proving runtimes, and Prometheus rules over it",
    "test_slurm_software": "a real Slurm cluster whose prolog asks runtimes",
    "test_real_nvidia": "NVIDIA's real user space, fetched and unpacked once",
}
SLOW_TESTS = {
    # Each waits out a lock timeout, a qualification or a daemon (15-40 s on 2 cores).
    "test_identity": (
        "test_the_epilog_trusts_only_a_window_the_daemon_attested_over_its_socket",
        "test_attested_runs_by_the_hundred_keep_the_history_bound_and_its_verdicts",
        "test_an_xid_on_the_gpu_of_a_mig_run_is_in_its_attested_window",
        "test_escape_sequences_in_a_run_another_user_wrote_never_reach_the_terminal",
        "test_a_flood_of_planted_records_neither_stalls_the_daemon_nor_grows_its_history",
        "test_a_run_that_ended_while_the_daemon_was_away_is_not_opened_again",
        "test_a_run_attested_before_a_daemon_restart_is_still_attested_after_it",
        "test_a_job_waiting_for_a_gpu_under_another_users_shared_lock_sleeps_and_names_it",
        "test_a_job_waiting_for_a_gpu_under_qualification_gets_it_within_seconds",
        "test_a_daemon_answer_that_does_not_hold_is_said_and_answered_here",
        "test_a_sighup_with_the_config_swapped_for_a_fifo_keeps_the_daemon_and_its_sigterm"),
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

# Each over 2 s in the inner loop (`pytest -m "not slow" -n 2 --durations=40`, 2026-12-01:
# real daemons, restarts, hangs, concurrent CLIs): CI runs them, the inner loop does not.
INNER_LOOP_SLOW: dict[str, tuple[str, ...]] = {
    "test_qualify_verdict": (
        "test_a_slow_gpu_blocks_with_qualification_block",
        "test_a_wrong_answer_blocks_its_gpu_and_a_slow_one_warns",
    ),
    "test_holds": (
        "test_an_xid_held_before_a_restart_ends_with_its_hold",
        "test_an_xid_held_before_a_restart_blocks_until_gpudiag_clear",
    ),
    "test_daemon_shutdown": (
        "test_sigterm_at_any_stage_stops_the_daemon_within_its_limit",
    ),
    "test_daemon_job_locks": (
        "test_a_gpudiag_run_holding_every_gpu_is_busy_to_the_daemon_within_one_nvml_interval",
    ),
    "test_forkserver": (
        "test_a_hung_forked_child_is_a_timeout_and_its_group_dies",
        "test_a_fork_server_dying_under_a_running_probe_never_hangs_the_caller",
    ),
    "test_qualify_daemon": (
        "test_the_daemon_qualifies_idle_gpus_and_exports_what_it_found",
        "test_qualify_requests_are_bounded_per_gpu_by_gpu_seconds_and_in_number",
        "test_a_full_qualification_by_the_daemon_yields_to_a_waiting_job_within_1_s",
    ),
    "test_truthful": (
        "test_eight_cuda_preflights_for_one_gpu_together_are_all_ready_on_a_named_gpu",
        "test_with_every_gpu_locked_by_jobs_a_missing_jax_plugin_is_still_known",
        "test_eight_jax_preflights_started_together_equal_the_lone_answer",
        "test_sixteen_mixed_commands_together_never_say_devices_busy",
        "test_admission_proves_a_backend_it_could_not_prove_before_it_runs_the_job",
        "test_siblings_exclusive_probe_lock_is_waited_for_not_called_busy",
        "test_with_every_gpu_locked_by_jobs_a_healthy_jax_is_unproven_never_ready",
        "test_admission_proves_cuda_on_the_gpu_it_locked",
    ),
    "test_hostile_local": (
        "test_a_fifo_renamed_over_a_held_lock_while_waiting_gives_125_and_a_closeout",
        "test_a_lock_file_another_user_created_cannot_be_removed_while_root_holds_it",
        "test_default_run_folders_are_fresh_private_and_unpredictable",
    ),
    "test_slow_questions": (
        "test_eight_waiting_health_questions_leave_metrics_healthz_readyz_under_100_ms",
    ),
    "test_qualify": (
        "test_a_slow_gpu_3_among_8_is_caught_against_table_and_peers",
    ),
    "test_attribution_runs": (
        "test_no_history_and_no_watcher_is_unknown_naming_why",
        "test_exit_1_with_no_gpu_event_is_the_application",
        "test_a_watcher_that_cannot_register_for_xids_leaves_a_failed_run_unknown",
        "test_cuinit_failing_mid_run_is_software",
        "test_a_row_remap_failure_mid_run_is_hardware_from_the_daemons_nvml_probe",
        "test_an_xid_79_during_a_run_without_a_daemon_is_hardware_with_the_xid",
        "test_an_application_xid_with_exit_1_is_the_application",
        "test_an_xid_79_during_a_run_with_a_daemon_is_hardware_from_its_history",
        "test_an_xid_on_another_gpu_is_not_the_jobs",
        "test_cuinit_failing_mid_run_without_a_daemon_is_software_by_the_post_run_check",
    ),
    "test_install": (
        "test_sdist_and_wheel_build_and_pass_twine_check",
    ),
    "test_probe_engine": (
        "test_each_fault_gives_its_code_end_to_end",
    ),
    "test_qualify_sdc": (  # 3-22 s each: several GPUs through children, a real daemon
        "test_three_gpus_one_busy_the_busy_one_untouched_a_record_per_idle_gpu_within_budget",
        "test_every_injected_memory_fault_is_a_memory_test_failure_with_its_evidence",
        "test_every_injected_gemm_bit_flip_is_a_compute_mismatch_with_its_element",
        "test_the_gpu_whose_golden_differs_from_its_7_peers_is_the_one_blocked_then_a_"
        "library_change_records_a_new_golden",
        "test_the_daemon_schedules_the_sdc_tier_and_a_bad_cell_blocks_its_gpu",
    ),
    "test_npd": (  # a real daemon on the fakes, the relay and the plugin: 2-5 s each
        "test_npd_gets_the_daemon_s_node_health_through_the_relay_without_gpudiag",
        "test_a_daemon_going_away_turns_the_answer_unknown_and_back",
        "test_once_prints_npd_s_message_and_exits_with_npd_s_code",
    ),
    "test_idle_wakeups": (  # they count wakeups over windows of 2-2.5 s
        "test_an_idle_http_listener_sleeps_instead_of_polling",
        "test_the_xid_supervisor_wakes_per_line_not_five_times_a_second",
    ),
    # Issue 50 (`pytest -n 2 -m "not slow" --durations=60`, 2026-12-05, load average 9-11:
    # 2811 tests in 616 s): each took 4-18 s there (real daemons, restarts, attested runs,
    # whole documented recipes, a static pass over the package).
    "test_reboots": (
        "test_a_reboot_class_hold_is_kept_in_its_boot_and_healed_by_a_reboot_and_a_clean_pass",
        "test_with_qualification_on_the_quick_tier_runs_before_the_reboot_releases_a_hold",
    ),
    "test_docs_run": ("test_every_documented_block_runs_as_written",),
    "test_day_one": (
        "test_qualify_prints_each_reason_once_and_says_what_it_compared_with",
        "test_a_host_without_a_driver_shows_the_root_cause_and_folds_its_consequences",
        "test_the_gpu_table_shows_what_nvidia_smi_users_scan_for",
        "test_serve_on_every_interface_without_read_only_warns_at_check_and_at_start",
        "test_cuda_init_failed_tells_the_operator_what_to_do_next",
        "test_a_gpu_less_host_shows_no_preallocation_line_and_says_why_cuda_is_blocked",
    ),
    "test_dead_code": ("test_gpudiag_defines_nothing_that_nothing_reads",),
    "test_store": ("test_jobs_are_pruned_apart_and_never_cost_the_verdict_history_its_place",
                   "test_history_cli_reads_text_and_json"),
    "test_one_deadline": (
        "test_a_mute_daemon_costs_one_connection_and_one_wait_on_both_paths",
        "test_a_slow_refusing_or_lying_daemon_costs_one_ask_and_the_same_answer_on_both_paths",
    ),
    "test_runtime_privilege": (
        "test_a_runtime_becoming_writable_while_the_daemon_runs_is_refused_and_nothing_runs_"
        "as_root",
        "test_a_root_daemon_runs_a_runtimes_children_as_nobody",
    ),
    "test_try_friction": (
        "test_the_xid_recipe_on_a_taken_port_says_the_daemon_ended_instead_of_hanging",
        "test_the_fakes_command_says_an_8_gpu_host",
    ),
    "test_socket": (
        "test_gpudiag_run_asks_the_daemon_on_the_socket",
        "test_a_second_daemon_on_the_same_socket_exits_2_and_the_first_keeps_it",
        "test_the_daemon_removes_its_socket_when_it_stops",
        "test_preflight_through_the_socket_says_source_daemon",
    ),
    "test_nvml_health": ("test_a_link_that_went_down_while_the_daemon_was_stopped_is_missed",),
    "test_hostile_secrets": ("test_no_planted_secret_reaches_a_record_artifact_or_output",),
    "test_nic_daemon": ("test_a_real_veth_cut_and_restored_gives_a_verdict_in_time_and_flaps",),
    "test_hostile_http": (
        "test_a_listener_whose_loop_died_makes_the_daemon_exit_instead_of_idling",),
    "test_clear": (
        "test_clear_names_a_gpu_by_index_uuid_prefix_or_pci_bus_id_as_nvidia_smi_does",),
}
for _module, _names in INNER_LOOP_SLOW.items():
    SLOW_TESTS[_module] = (*SLOW_TESTS.get(_module, ()), *_names)


def _shares_a_fixture_of_its_module(item: pytest.Item) -> bool:
    """Whether the test uses a fixture its own module defines for more than one test (scope
    class, module or session: a daemon, a Slurm cluster, a booted machine, an image)."""
    info = getattr(item, "_fixtureinfo", None)
    module = getattr(getattr(item, "module", None), "__name__", None)
    if info is None or module is None:
        return False
    return any(d.scope != "function" and getattr(d.func, "__module__", None) == module
               for defs in info.name2fixturedefs.values() for d in defs)


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests of SLOW_MODULES and SLOW_TESTS slow, and keep the tests of a module
    that share one of its fixtures on one xdist worker (`--dist loadgroup`, the README's
    command): spread over two workers, each would build it (two daemons, two clusters). The
    other tests go to whichever worker is free."""
    for item in items:
        module = item.path.stem
        function = getattr(item, "originalname", item.name)
        if module in SLOW_MODULES or function in SLOW_TESTS.get(module, ()):
            item.add_marker(pytest.mark.slow)
        if _shares_a_fixture_of_its_module(item):
            item.add_marker(pytest.mark.xdist_group(module))


# Every process the session starts carries a mark in its environment (tests/support/
# survivors.py): the session-end check finds what a test left running even when its command
# line names no temporary folder (a fake job's `sleep`). The controller draws it before xdist
# starts its workers, which inherit it; a pytest session a test starts draws its own, so it
# never counts its parent's processes.
def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        mark_session()


def pytest_unconfigure(config: pytest.Config) -> None:
    # Every process imports this file and so makes its SESSION_LOCKS (the xdist controller,
    # which runs no fixture, too): each removes its own.
    shutil.rmtree(SESSION_LOCKS, ignore_errors=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """No process a test starts outlives the session (issue 50): any survivor is listed,
    killed, and fails the run."""
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller looks once every worker is done
    factory = getattr(session.config, "_tmp_path_factory", None)
    basetemp = getattr(factory, "_basetemp", None)
    mark = os.environ.get(SESSION_MARK)
    if basetemp is None or not mark:
        return
    lines = kill(survivors(str(basetemp), mark))
    if lines:
        sys.stderr.write("\ntests left processes running (killed now):\n" + "\n".join(lines)
                         + "\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
