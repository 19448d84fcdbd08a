"""Day one as a new operator meets it (issue 41): each item through the real CLI on the fakes."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from tests.support.host import EnvFactory, run_gpudiag, verdict_of
from tests.support.tty import run_on_tty, strip_ansi


def test_preflight_gpus_n_chooses_the_healthiest_free_gpus_and_says_why(
        gpu_env: EnvFactory) -> None:
    # Four GPUs; the first two run on x8 of their x16 PCIe links (a warning, not a blocker).
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=4, FAKE_NVML_PCIE="0:5/5/8/16,1:5/5/8/16")
    rc, record = verdict_of(["preflight", "--gpus", "2", "--no-daemon", "--format", "json"],
                            env)
    assert rc == 0, record["blockers"]
    chosen = [d["index"] for d in record["devices"] if d["selected"]]
    assert chosen == [2, 3]
    for d in record["devices"]:
        why = d["selection"]
        if d["index"] in (2, 3):
            assert why.startswith("chosen: healthy and free, no warning"), why
        else:
            assert why.startswith("not chosen:") and "gpu_pcie_link_degraded" in why, why
    # Each reason once, and only with --gpus.
    rc, record = verdict_of(["preflight", "--no-daemon", "--format", "json"], env)
    assert {d["selection"] for d in record["devices"]} == {None}


@pytest.mark.parametrize("error", [999, 3, 101])
def test_cuda_init_failed_tells_the_operator_what_to_do_next(gpu_env: EnvFactory,
                                                            error: int) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=1, FAKE_CUDA_INIT_ERROR=error)
    proc = run_gpudiag(["preflight", "--no-daemon"], env)
    assert proc.returncode == 1
    rc, record = verdict_of(["preflight", "--no-daemon", "--format", "json"], env)
    assert record["gpu_validation_blocker"] == "cuda_init_failed"
    fix = record["blockers"][0]["remediation"]
    assert "nvidia-uvm" in fix and "dmesg" in fix and "nvidia-smi -r" in fix
    assert "nvidia-uvm" in proc.stdout + proc.stderr  # the terminal shows the fix too


GPUDIAG = [sys.executable, "-m", "gpudiag"]


@pytest.mark.parametrize("columns", [80, 120])
def test_a_cuda_only_answer_on_a_terminal_has_no_jax_line_and_no_doubled_tags(
        gpu_env: EnvFactory, columns: int) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=2, FAKE_CUDA_CTX_ERROR=999)
    rc, text = run_on_tty([*GPUDIAG, "preflight", "--no-daemon"], env, columns=columns)
    assert rc == 1, text
    assert "preallocation_disabled" not in text  # JAX's setting: not for a cuda question
    assert "[cuda, cuda" not in text and "[cuda, GPU" in text, text
    too_wide = [line for line in text.splitlines()
                if len(line) > columns and "⠋" not in line]  # the spinner redraws in place
    assert too_wide == [], text


@pytest.mark.parametrize("columns", [80, 120])
def test_a_host_without_a_driver_shows_the_root_cause_and_folds_its_consequences(
        bare_env: dict[str, str], columns: int) -> None:
    rc, text = run_on_tty([*GPUDIAG, "probe"], bare_env, columns=columns)
    assert rc == 1, text
    blockers = text.split("Blockers (", 1)[1]
    total = int(blockers.split(")", 1)[0])
    assert total > 1
    # The root cause in full (message and fix), each consequence on one line under it.
    assert blockers.count("fix: ") < total
    assert "then, because of it" in blockers
    rc, wide = run_on_tty([*GPUDIAG, "probe", "--wide"], bare_env, columns=columns)
    assert wide.split("Blockers (", 1)[1].count("fix: ") == total  # --wide: each in full


@pytest.mark.parametrize("columns", [80, 120])
def test_the_watch_header_keeps_its_clock_at_any_width(gpu_env: EnvFactory,
                                                       columns: int) -> None:
    from tests.support.tty import watch_on_tty

    env = gpu_env(FAKE_NVML_DEVICE_COUNT=1)
    argv = ["health", "--require", "cuda,nvml", "--no-daemon", "--watch", "0.5"]
    rc, raw = watch_on_tty(argv, env, columns, [
        (lambda s: "gpu_validation_blocker=" in s, lambda: None)])
    screen = strip_ansi(raw.decode(errors="replace"))
    heads = [line for line in screen.splitlines() if "every 0.5 s" in line]
    assert heads, screen
    for head in heads:
        assert len(head) <= columns and re.search(r"\d\d:\d\d:\d\dZ$", head.rstrip()), head


@pytest.mark.parametrize("columns", [40, 80, 120])
def test_a_watch_frame_cuts_a_long_title_never_the_clock(columns: int) -> None:
    from gpudiag.cli.watch import frame
    from tests.support.verdicts import verdict

    title = "every 0.5 s: gpudiag health " + ",".join(["cuda", "nvml"] * 20) + "  (Ctrl-C ends)"
    head = strip_ansi(frame(verdict(), title, columns, 50, False)).splitlines()[0]
    assert len(head) <= columns and re.search(r"\d\d:\d\d:\d\dZ$", head), head


GPU_A = "GPU-f00d0000-0000-4000-8000-000000000000"
GPU_B = "GPU-f00d0001-0000-4000-8000-000000000001"


def _a_run_and_a_history(tmp_path: Path) -> tuple[Path, Path]:
    """A failed run's folder on GPU A (its closeout and result), and a history in which GPU B
    had an XID during the run and GPU A one too."""
    from gpudiag.core.attribution import Attribution
    from gpudiag.core.findings import XidEvent
    from gpudiag.daemon.store import HistoryStore, default_path

    run = tmp_path / "run"
    run.mkdir()
    attribution = {**Attribution("unknown", "evidence_missing", (), ()).record(),
                   "window": {"start": 1000.0, "end": 1010.0, "gpus": [GPU_A]}}
    (run / "closeout.json").write_text(json.dumps(
        {"exit_code": 1, "host": "node1", "attribution": attribution}))
    (run / "result.json").write_text(json.dumps({"pid": 4242, "argv": ["python", "t.py"]}))
    state = tmp_path / "state"
    state.mkdir()
    store = HistoryStore(default_path(state))
    store.record_xids([XidEvent(79, 0, GPU_A, 1005.0), XidEvent(31, 1, GPU_B, 1006.0)])
    store.close()
    return run, state


def test_explain_of_a_run_reads_cleanly_and_shows_only_the_run_s_gpus(tmp_path: Path) -> None:
    run, state = _a_run_and_a_history(tmp_path)
    env = dict(os.environ)
    proc = run_gpudiag(["explain", "--run", str(run), "--state-dir", str(state)], env)
    assert proc.returncode == 0, proc.stderr
    assert "pid -1" not in proc.stdout and "the the" not in proc.stdout
    assert "run: job pid 4242, exit 1: python t.py" in proc.stdout, proc.stdout
    assert GPU_A in proc.stdout and GPU_B not in proc.stdout, proc.stdout
    every = run_gpudiag(["explain", "--run", str(run), "--state-dir", str(state),
                         "--all-gpus"], env)
    assert GPU_B in every.stdout, every.stdout
    # Without a history: from the run's own record, in plain words.
    alone = run_gpudiag(["explain", "--run", str(run), "--state-dir", str(tmp_path / "none")],
                        env)
    assert alone.returncode == 0, alone.stderr
    assert "from the run's own record" in alone.stdout and "the the" not in alone.stdout


RFC3339_MS = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"


def test_history_logs_and_records_share_one_time_format(tmp_path: Path) -> None:
    import io
    import logging

    from gpudiag.cli.daemon import setup_logging
    from gpudiag.daemon.store import HistoryStore, default_path
    from tests.support.verdicts import verdict

    state = tmp_path / "state"
    state.mkdir()
    store = HistoryStore(default_path(state))
    store.record(verdict(("gpu_lost", "GPU-1")), now=1_700_000_000.25)
    store.close()
    proc = run_gpudiag(["history", "--state-dir", str(state)], dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "gpu_lost" in line]
    assert lines and all(re.match(RFC3339_MS, line) for line in lines), proc.stdout
    assert "2023-11-14T22:13:20.250Z" in proc.stdout
    # The daemon's logs, text and JSON, write the same format.
    for fmt in ("text", "json"):
        setup_logging(fmt, "info")
        handler = logging.getLogger("gpudiag").handlers[0]
        handler.setStream(buffer := io.StringIO())  # type: ignore[attr-defined]
        logging.getLogger("gpudiag.test").info("hello")
        line = buffer.getvalue()
        assert re.search(rf"^{RFC3339_MS} INFO|\"ts\": \"{RFC3339_MS}\"", line), line


@pytest.mark.parametrize("name", ["1", "GPU-f00d0001-0000-4000-8000-000000000001",
                                  "GPU-f00d0001", "00000000:19:00.0", "19:00.0"])
def test_preflight_devices_takes_every_name_of_a_gpu(gpu_env: EnvFactory, name: str) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=2)
    rc, record = verdict_of(["preflight", "--no-daemon", "--devices", name, "--format",
                             "json"], env)
    assert rc == 0, record["blockers"]
    assert [d["uuid"] for d in record["devices"]] == [GPU_B]


def test_a_gpu_name_that_matches_nothing_says_which_gpus_are_here(gpu_env: EnvFactory) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=2)
    rc, record = verdict_of(["preflight", "--no-daemon", "--devices", "GPU-beef", "--format",
                             "json"], env)
    assert rc == 1
    (blocker,) = record["blockers"]  # once, not again as "ask for fewer devices"
    assert blocker["message"].startswith("no GPU named 'GPU-beef'; GPUs here (index, UUID, "
                                         "PCI bus id): 0 GPU-f00d0000"), blocker["message"]
    assert "19:00.0" in blocker["message"]
    proc = run_gpudiag(["preflight", "--no-daemon", "--devices", "GPU-f00d000"], env)
    assert proc.returncode == 1 and "names 2 GPUs" in proc.stdout, proc.stdout


def _history_with_devices(state: Path) -> None:
    """A history whose last verdict saw GPU A (index 0) and GPU B (index 1)."""
    from dataclasses import replace

    from gpudiag.core.verdict import DeviceInfo
    from gpudiag.daemon.store import HistoryStore, default_path
    from tests.support.verdicts import verdict

    devices = (DeviceInfo(0, GPU_A, "NVIDIA H200", "00000000:18:00.0", None, None),
               DeviceInfo(1, GPU_B, "NVIDIA H200", "00000000:19:00.0", None, None))
    store = HistoryStore(default_path(state))
    store.record(replace(verdict(), devices=devices), now=900.0)
    store.close()


@pytest.mark.parametrize("name", ["1", "GPU-f00d0001", "19:00.0", GPU_B])
def test_explain_gpus_takes_every_name_of_a_gpu(tmp_path: Path, name: str) -> None:
    _, state = _a_run_and_a_history(tmp_path)
    _history_with_devices(state)
    proc = run_gpudiag(["explain", "--since", "990", "--until", "1020", "--gpus", name,
                        "--state-dir", str(state), "--format", "json"], dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout)
    assert answer["window"]["gpus"] == [GPU_B]
    assert {r["gpu"] for r in answer["timeline"]} <= {GPU_B, None}


def test_clear_qualify_and_explain_word_an_unknown_gpu_name_alike(tmp_path: Path,
                                                                  gpu_env: EnvFactory) -> None:
    _, state = _a_run_and_a_history(tmp_path)
    _history_with_devices(state)
    explain = run_gpudiag(["explain", "--since", "990", "--until", "1020", "--gpus", "7",
                           "--state-dir", str(state)], dict(os.environ))
    clear = run_gpudiag(["clear", "--gpu", "7", "--state-dir", str(state)], dict(os.environ))
    qualify = run_gpudiag(["qualify", "--gpus", "7", "--no-history"],
                          gpu_env(FAKE_NVML_DEVICE_COUNT=2))
    for proc in (explain, clear, qualify):
        assert proc.returncode == 2, proc.stderr
        assert "no GPU named '7'; GPUs here (index, UUID, PCI bus id): 0 GPU-f00d0000" in (
            " ".join(proc.stderr.split())), proc.stderr


ROOT = Path(__file__).resolve().parent.parent


def _cli_commands() -> dict[str, str]:
    import click

    from gpudiag.cli.commands import cli

    ctx = click.Context(cli)
    return {n: cli.get_command(ctx, n).get_short_help_str(200)  # type: ignore[union-attr]
            for n in cli.list_commands(ctx)}


def _table(text: str, heading: str) -> list[list[str]]:
    """The rows of the first Markdown table after ``heading``, as cells."""
    section = text.split(heading, 1)[1]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
            if not set(cells[0]) <= set("-: "):
                rows.append(cells)
        elif rows:
            break
    return rows[1:]  # less the header row


def _named(cell: str) -> list[str]:
    """`gpudiag probe`, `preflight` -> ["probe", "preflight"]."""
    return [w.removeprefix("gpudiag ").split()[0] for w in re.findall(r"`([^`]+)`", cell)]


def test_the_readme_and_reference_command_tables_are_the_cli_s() -> None:
    commands = _cli_commands()
    readme = (ROOT / "README.md").read_text()
    listed = [_named(row[0])[0] for row in _table(readme, "## Commands")]
    assert sorted(listed) == sorted(commands), listed  # each command once, none missing
    reference = (ROOT / "docs" / "reference.md").read_text()
    rows = {row[0]: row[1] for row in _table(reference, "## Commands")}
    assert rows == {f"`gpudiag {n}`": help for n, help in commands.items()}
    exits = [n for row in _table(reference, "## Exit codes") for n in _named(row[0])]
    # `gpudiag run` exits with its child's code: its own paragraph under the table.
    assert sorted(exits) == sorted(set(commands) - {"run"}), exits
    assert "`gpudiag run`: the child's own exit code" in reference


def test_the_docs_say_one_thing_about_history_and_sighup() -> None:
    reference = (ROOT / "docs" / "reference.md").read_text()
    assert reference.count("| `GET /v1/history") == 1
    daemon = (ROOT / "docs" / "daemon.md").read_text()
    assert "no live reload" not in daemon and "**Live reload**: SIGHUP" in daemon
    readme = (ROOT / "README.md").read_text()
    assert "slurm-wlm and munge" in readme and "fleet" in readme.split("## How it is built")[1]


def test_operations_md_names_the_slurm_scripts_where_install_node_puts_them() -> None:
    ops = (ROOT / "docs" / "operations.md").read_text().split("## Slurm", 1)[1]
    install = (ROOT / "scripts" / "install-node.sh").read_text()
    prefix = re.search(r"\bprefix=(\S+)", install).group(1)  # type: ignore[union-attr]
    assert '"$here/deploy/slurm" "$prefix/share/gpudiag/"' in install
    conf = dict(re.findall(r"^(Prolog|Epilog|HealthCheckProgram)=(\S+)$", ops, re.M))
    assert set(conf) == {"Prolog", "Epilog", "HealthCheckProgram"}, conf
    for key, path in conf.items():
        assert path.startswith(f"{prefix}/share/gpudiag/slurm/"), (key, path)
        script = ROOT / "deploy" / "slurm" / Path(path).name
        assert script.is_file(), script
        assert f"{key}={path}" in script.read_text(), f"{script.name}'s header names {path}"
    assert "**Epilog**" in ops


def test_serve_on_every_interface_without_read_only_warns_at_check_and_at_start(
        fakes: object, tmp_path: Path) -> None:
    from tests.support.daemon import Daemon, daemon_toml, host_env, write_config

    check = run_gpudiag(["serve", "--listen", "0.0.0.0:0", "--check-config"], dict(os.environ))
    assert check.returncode == 0, check.stderr
    assert "without tcp_read_only" in check.stderr and "config OK" in check.stdout
    quiet = run_gpudiag(["serve", "--listen", "127.0.0.1:0", "--check-config"],
                        dict(os.environ))
    assert "warning" not in quiet.stderr
    cfg = tmp_path / "ro.toml"
    cfg.write_text("tcp_read_only = true\n")
    read_only = run_gpudiag(["serve", "--listen", "0.0.0.0:0", "--config", str(cfg),
                             "--check-config"], dict(os.environ))
    assert "warning" not in read_only.stderr, read_only.stderr
    env = host_env(fakes, tmp_path / "host", gpus=1)  # type: ignore[arg-type]
    daemon = Daemon(env, write_config(tmp_path / "gpudiag.toml", daemon_toml({})),
                    tmp_path / "state", extra_args=("--listen", "0.0.0.0:0"))
    try:
        warned = [json.loads(line) for line in daemon.lines if "tcp_read_only" in line]
    finally:
        daemon.stop()
    assert warned and warned[0]["level"] == "warning", daemon.lines[:5]


@pytest.mark.parametrize("columns", [80, 120])
def test_the_gpu_table_shows_what_nvidia_smi_users_scan_for(gpu_env: EnvFactory,
                                                           columns: int) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=3, FAKE_NVML_PCIE="1:5/5/8/16",
                  FAKE_NVML_PERSISTENCE="2:0", FAKE_NVML_POWER_MW="0:123000",
                  FAKE_NVML_CLOCKS_MHZ="0:1755/2619", FAKE_NVML_PSTATE="2:8",
                  FAKE_NVML_FAN_PCT="0:40")
    probe = [*GPUDIAG, "probe", "--backend", "host,nvml,cuda"]
    rc, text = run_on_tty(probe, env, columns=columns)
    rows = {int(m.group(1)): m.group(0) for m in
            re.finditer(r"^\s+(\d)\s+(ready|selected)\b.*$", text, re.M)}
    assert set(rows) == {0, 1, 2}, text
    # The status column says what is off, in words.
    assert "ready, PCIe narrowed" in rows[1], rows[1]
    table = text.split("Devices:", 1)[1].split("Warnings", 1)[0]
    # At 80 columns the status may wrap onto a second line, words whole.
    assert re.search(r"ready, persistence off|ready, persistence .*\n\s+off\b", table), table
    assert all(len(line) <= columns for line in text.splitlines() if "⠋" not in line)
    # --wide: power draw/cap, SM/memory clocks, P-state, fan and ECC counts per GPU.
    rc, wide = run_on_tty([*probe, "--wide"], env, columns=columns)
    header = next(line for line in wide.splitlines() if "gpu" in line and "status" in line)
    for col in ("power", "clocks", "pstate", "fan", "ECC c/u"):
        assert col in header, header
    row0 = next(line for line in wide.splitlines() if re.match(r"^\s+0\s+ready", line))
    assert "123/700W" in row0 and "1755/2619MHz" in row0 and "P0" in row0, row0
    assert "40%" in row0 and "0/0" in row0, row0
    row2 = next(line for line in wide.splitlines() if re.match(r"^\s+2\s+ready", line))
    assert "P8" in row2 and " - " in row2 + " ", row2  # no fan on a chassis-cooled GPU
    record = json.loads(run_gpudiag(["probe", "--backend", "host,nvml,cuda", "--format",
                                     "json"], env).stdout)
    first = record["devices"][0]
    assert (first["power_w"], first["power_limit_w"], first["sm_clock_mhz"],
            first["memory_clock_mhz"], first["pstate"], first["fan_ratio"]) == (
        123.0, 700.0, 1755, 2619, 0, 0.4)


@pytest.mark.parametrize("name", [None, "NVIDIA Z100 Prototype"])
def test_qualify_prints_each_reason_once_and_says_what_it_compared_with(
        gpu_env: EnvFactory, name: str | None) -> None:
    knobs: dict[str, str | int] = {"FAKE_NVML_DEVICE_COUNT": 2}
    if name is not None:
        knobs["FAKE_GPU_NAME"] = name
    env = gpu_env(**knobs)
    text = run_gpudiag(["qualify", "--tier", "quick", "--no-history"], env).stdout
    record = json.loads(run_gpudiag(["qualify", "--tier", "quick", "--no-history",
                                     "--format", "json"], env).stdout)
    for q in record["gpus"]:
        low = [s["measure"] for s in q["scores"] if any(r["below"] for r in s["references"])]
        if low:
            assert q["message"] not in text  # the measures' lines say it, once
            assert f"low: {', '.join(low)}" in text
    compared = "no data-sheet row for 'NVIDIA Z100 Prototype': compared with its node peers"
    assert (compared in text) == (name is not None), text


def test_a_one_shot_probe_flags_an_nvlink_down_since_boot_against_its_peers(
        gpu_env: EnvFactory) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=4, FAKE_NVML_NVLINKS="0:18,1:18,2:18,3:18",
                  FAKE_NVML_NVLINK_DOWN="2:16/17")
    rc, record = verdict_of(["probe", "--backend", "host,nvml,cuda", "--format", "json"], env)
    down = [b for b in record["blockers"] if b["code"] == "gpu_nvlink_down"]
    assert [b["device"] for b in down] == ["GPU-f00d0002-0000-4000-8000-000000000002"], (
        record["blockers"])
    assert "16 NVLink link(s) active, 18 on its 3 peers of the same model" in down[0]["message"]
    assert rc == 1
    # All alike (a PCIe-bridged model with fewer links, say): nothing to compare against.
    same = gpu_env(FAKE_NVML_DEVICE_COUNT=4, FAKE_NVML_NVLINKS="0:12,1:12,2:12,3:12")
    rc, record = verdict_of(["probe", "--backend", "host,nvml,cuda", "--format", "json"], same)
    assert not [b for b in record["blockers"] if b["code"] == "gpu_nvlink_down"]


def test_an_explicit_daemon_url_that_does_not_answer_says_so_and_the_default_stays_quiet(
        gpu_env: EnvFactory, tmp_path: Path) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=1)
    url = f"unix:{tmp_path}/none.sock"
    loud = run_gpudiag(["preflight", "--format", "kv", "--daemon-url", url], env)
    assert "source=inline" in loud.stdout
    assert f"gpudiag: no daemon at {url}" in loud.stderr and "ran the probes here" in loud.stderr
    quiet = run_gpudiag(["preflight", "--format", "kv"], {**env, "GPUDIAG_DAEMON_URL": url})
    assert "source=inline" in quiet.stdout and quiet.stderr == "", quiet.stderr


def test_a_gpu_less_host_shows_no_preallocation_line_and_says_why_cuda_is_blocked(
        bare_env: dict[str, str]) -> None:
    proc = run_gpudiag(["probe", "--backend", "host,nvml,cuda,jax"], bare_env)
    assert proc.returncode == 1, proc.stderr
    assert "preallocation_disabled" not in proc.stdout  # no GPU: nothing to share
    (cuda,) = [line for line in proc.stdout.splitlines() if line.startswith("cuda ")]
    assert "library=missing" in cuda, cuda
