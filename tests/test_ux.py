"""Issue 16, as a person would use gpudiag: terminal output at 80 and 120 columns and in pipes,
one status word per GPU, errors with exit 2 and a hint, help with examples."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpudiag.core.catalog import BLOCKERS
from tests.fakes.build import FakeDriver, write_state_file
from tests.support.daemon import Daemon, daemon_toml, host_env, wait_for, write_config
from tests.support.docs import doc_blocks
from tests.support.host import EnvFactory, free_port, run_gpudiag, verdict_of
from tests.support.run import run_folder
from tests.support.tty import run_on_tty

PROBE = [sys.executable, "-m", "gpudiag", "probe", "--backend", "host,nvml,cuda"]
UUIDS = [f"GPU-f00d{i:04x}" for i in range(8)]


@pytest.fixture
def sleeper() -> Iterator[int]:
    """A real process to stand for another user's job on a fake GPU."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _hosts(pid: int) -> dict[str, dict[str, str | int]]:
    return {"healthy": {},
            "lost": {"FAKE_NVML_DEVICE_ERRORS": "1:15"},
            "busy": {"FAKE_NVML_PROCESSES": f"2:{pid}:20000",
                     "FAKE_NVML_MEMORY_USED_MIB": "2:20000", "FAKE_NVML_UTILIZATION": "2:97",
                     "FAKE_NVML_TEMPERATURE_C": "2:71"}}


def _device_rows(text: str) -> dict[int, str]:
    """The devices table's rows by GPU index."""
    rows = {}
    body = text.split("Devices", 1)[1].split("\nProcesses", 1)[0]
    for line in body.splitlines():
        m = re.match(r"^\s*([0-7])\s{2,}(\S.*)$", line)
        if m:
            rows[int(m.group(1))] = m.group(2)
    return rows


@pytest.mark.parametrize("columns", [80, 120])
@pytest.mark.parametrize("host", ["healthy", "lost", "busy"])
def test_probe_fits_the_terminal_with_one_status_word_per_gpu(
        gpu_env: EnvFactory, sleeper: int, host: str, columns: int) -> None:
    rc, text = run_on_tty(PROBE, gpu_env(**_hosts(sleeper)[host]), columns=columns)
    # `gpudiag probe` asks the node-health question: a busy GPU shows busy, it blocks nothing.
    assert rc == (1 if host == "lost" else 0), text
    out = text[text.index("host "):]  # past the spinner's frames (stderr, same terminal)
    too_wide = [line for line in out.splitlines() if len(line.rstrip()) > columns]
    assert too_wide == [], "\n".join(too_wide)
    rows = _device_rows(out)
    assert sorted(rows) == list(range(8))
    for i, row in rows.items():  # unique UUID prefixes and short PCI addresses, never cut
        if host == "lost" and i == 1:
            assert row.split()[0] == "lost"
            continue
        assert UUIDS[i] in row.split() and f"{0x18 + i:02X}:00.0" in row
        assert "…" not in row
    if host == "busy":
        assert re.search(rf"busy pid {sleeper}\s", rows[2]) and "97%" in rows[2]
        assert "71C" in rows[2] and "19.5 GiB" in rows[2]
        assert all(rows[i].startswith("ready") for i in (0, 1, 3))
    if host == "lost":
        assert "gpu_lost  [device, nvml, GPU 1]" in out  # the code whole, on its own line
    assert "CUDA 12.8" in out and "12080" not in out
    backends = [line.split()[0] for line in out.split("Backends", 1)[1].splitlines()
                if line.split() and line.split()[0] in ("host", "nvml", "cuda")]
    assert backends == ["host", "nvml", "cuda"]
    assert re.search(r"^host \S+, source inline, just now \(checked \S+\)$", out, re.M)
    assert out.rstrip().splitlines()[-1].startswith("gpu_validation_blocker=")


@pytest.mark.parametrize(("columns", "width"), [("80", 80), (None, 120)])
def test_piped_text_follows_columns_else_120(gpu_env: EnvFactory, columns: str | None,
                                             width: int) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_ERRORS="1:15")
    if columns:
        env["COLUMNS"] = columns
    proc = run_gpudiag(["probe", "--backend", "host,nvml,cuda"], env)
    assert proc.returncode == 1
    assert max(len(line) for line in proc.stdout.splitlines()) <= width
    assert "\x1b[" not in proc.stdout  # no colour into a pipe
    assert "gpu_lost" in proc.stdout and "GPU-f00d0000 " in proc.stdout


def test_every_device_status_word_of_the_catalog_is_one_of_its_codes() -> None:
    from gpudiag.cli.render import STATUS_WORDS
    from gpudiag.core.catalog import WARNINGS

    assert set(STATUS_WORDS) <= set(BLOCKERS) | set(WARNINGS)


# A fault on GPU 3 for each device-layer code the devices table names with a status word.
GPU3_FAULTS = {"gpu_lost": {"FAKE_NVML_DEVICE_ERRORS": "3:15"},
               "gpu_reset_required": {"FAKE_NVML_DEVICE_ERRORS": "3:16"},
               "gpu_inforom_corrupted": {"FAKE_NVML_DEVICE_ERRORS": "3:14"},
               "gpu_ecc_uncorrectable": {"FAKE_NVML_ECC_VOLATILE_UNCORRECTED": "3:2"}}


@pytest.mark.parametrize("code", [c for c in BLOCKERS if c in GPU3_FAULTS])
def test_a_faulty_gpus_row_says_its_fault_in_one_word(gpu_env: EnvFactory, code: str) -> None:
    from gpudiag.cli.render import STATUS_WORDS

    env = gpu_env(**GPU3_FAULTS[code])
    env["COLUMNS"] = "100"
    proc = run_gpudiag(["probe", "--backend", "host,nvml,cuda"], env)
    assert proc.returncode == 1 and f"gpu_validation_blocker={code}" in proc.stdout
    rows = _device_rows(proc.stdout)
    assert rows[3].startswith(STATUS_WORDS[code] + " "), proc.stdout
    assert rows[0].split()[0] == "ready"


def test_daemon_and_preflight_text_show_source_and_age(gpu_env: EnvFactory) -> None:
    proc = run_gpudiag(["preflight", "--no-daemon", "--require", "iree:local-task"], gpu_env())
    assert proc.returncode == 0, proc.stderr
    assert "source inline" in proc.stdout
    # preallocation means something for JAX only: no line about it for IREE (issue 41).
    assert "preallocation_disabled" not in proc.stdout


def test_probe_accepts_format_like_preflight_and_keeps_json(gpu_env: EnvFactory) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=2)
    rc, record = verdict_of(["probe", "--backend", "nvml", "--format", "json"], env)
    assert rc == 0 and record["devices"][0]["utilization_ratio"] == 0
    assert record["devices"][0]["pids"] == [] and record["devices"][0]["temperature_c"] == 35
    rc, again = verdict_of(["probe", "--backend", "nvml", "--json"], env)
    assert rc == 0 and again["schema"] == record["schema"]
    proc = run_gpudiag(["probe", "--backend", "nvml", "--format", "kv"], env)
    assert proc.returncode == 0 and "gpu_validation_blocker=none" in proc.stdout.splitlines()
    proc = run_gpudiag(["probe", "--json", "--format", "kv"], env)
    assert proc.returncode == 2 and "disagree" in proc.stderr


@pytest.mark.parametrize("where", ["missing", "folder", "readonly"])
def test_a_bad_record_path_is_exit_2_before_any_probe(gpu_env: EnvFactory, tmp_path: Path,
                                                      where: str) -> None:
    log = tmp_path / "contexts.log"
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    path = {"missing": tmp_path / "no" / "v.json", "folder": tmp_path,
            "readonly": ro / "v.json"}[where]
    proc = run_gpudiag(["preflight", "--no-daemon", "--record", str(path)],
                       gpu_env(FAKE_CUDA_CONTEXT_LOG=str(log)))
    if where == "readonly" and ro.stat().st_uid == 0 and os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    assert proc.returncode == 2, proc.stderr
    said = "is a directory" if where == "folder" else f"could not write --record {path}"
    assert said in proc.stderr and "Traceback" not in proc.stderr
    assert not log.exists()  # no probe touched a GPU
    assert proc.stdout == ""


def test_history_without_daemon_state_is_a_usage_error_with_a_hint(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "STATE_DIRECTORY"}
    proc = run_gpudiag(["history", "--state-dir", str(tmp_path / "none")], env)
    assert proc.returncode == 2
    assert "gpudiag serve" in proc.stderr and "--state-dir" in proc.stderr


COMMANDS = ["probe", "preflight", "health", "serve", "history", "run", "clear", "fleet",
            "qualify", "npd-relay"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_examples_and_defaults_written_one_way(command: str) -> None:
    proc = run_gpudiag([command, "--help"], {**os.environ, "COLUMNS": "100"})
    assert proc.returncode == 0
    assert "Examples:" in proc.stdout and f"gpudiag {command}" in proc.stdout
    assert "(default" not in proc.stdout.replace("\n", " ")  # always "[default: ...]"


def test_command_list_summaries_are_whole_sentences() -> None:
    proc = run_gpudiag(["--help"], {**os.environ, "COLUMNS": "120"})
    listed = proc.stdout.split("Commands:", 1)[1]
    for command in COMMANDS:
        line = next(ln for ln in listed.splitlines() if ln.split()[:1] == [command])
        assert not line.rstrip().endswith("..."), line
        assert line.rstrip().endswith((".", "?", "1.")), line


def test_check_config_prints_the_effective_configuration(tmp_path: Path) -> None:
    from gpudiag.daemon.config import load_config

    config = tmp_path / "d.toml"
    config.write_text("listen = \"127.0.0.1:9999\"\n[backends.jax]\nenabled = false\n")
    proc = run_gpudiag(["serve", "--config", str(config), "--check-config",
                        "--state-dir", str(tmp_path)], dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    first, rest = proc.stdout.split("\n", 1)
    assert "config OK: listen 127.0.0.1:9999" in first
    assert f"--state-dir {tmp_path}" in rest
    # The TOML it prints is a config file that gives the very same configuration.
    effective = tmp_path / "effective.toml"
    effective.write_text(rest)
    assert load_config(effective) == load_config(config)
    assert "[backends.jax]\nenabled = false" in rest and "[history]" in rest


@pytest.mark.parametrize(("argv", "knobs", "code"), [
    ([sys.executable, "-c", "pass"], {}, 0),
    (["/no/such/program"], {}, 127),
    (["true"], {"FAKE_NVML_INIT_ERROR": 9}, 125),
])
def test_run_says_where_the_closeout_went_on_every_outcome(
        gpu_env: EnvFactory, tmp_path: Path, argv: list[str], knobs: dict[str, int],
        code: int) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=2, GPUDIAG_LOCK_DIR=str(tmp_path / "locks"),
                  GPUDIAG_DAEMON_URL="http://127.0.0.1:9", **knobs)
    art = tmp_path / "art"
    proc = run_gpudiag(["run", "--artifacts", str(art), "--", *argv], env)
    assert proc.returncode == code, proc.stderr
    assert f"gpudiag run: closeout {run_folder(art) / 'closeout.txt'}" in proc.stderr
    assert (run_folder(art) / "closeout.txt").is_file()
    if code == 125:  # a refusal says what to do about it
        assert "gpudiag run: refused: driver_not_loaded" in proc.stderr
        assert f"gpudiag run: fix: {BLOCKERS['driver_not_loaded'].remediation}" in proc.stderr


def test_run_artifacts_default_outside_the_folder_one_stands_in(gpu_env: EnvFactory,
                                                               tmp_path: Path) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=1, GPUDIAG_LOCK_DIR=str(tmp_path / "locks"),
                  GPUDIAG_DAEMON_URL="http://127.0.0.1:9", XDG_STATE_HOME=str(tmp_path / "st"))
    env.pop("GPUDIAG_ARTIFACTS_DIR", None)
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    proc = subprocess.run([sys.executable, "-m", "gpudiag", "run", "--", "true"], env=env,
                          cwd=checkout, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert list(checkout.iterdir()) == []
    runs = list((tmp_path / "st" / "gpudiag" / "runs").iterdir())
    assert len(runs) == 1 and f"closeout {runs[0] / 'closeout.txt'}" in proc.stderr
    assert "gpudiag-runs/" in (Path(__file__).parents[1] / ".gitignore").read_text()


def test_one_iree_driver_rule_for_the_cli_and_http(gpu_env: EnvFactory) -> None:
    from gpudiag.core.limits import IREE_DRIVERS
    from gpudiag.daemon.app import HTTP_IREE_DRIVERS

    assert HTTP_IREE_DRIVERS == IREE_DRIVERS
    proc = run_gpudiag(["preflight", "--no-daemon", "--require", "iree:nosuch"], gpu_env())
    assert proc.returncode == 2 and "'nosuch'" in proc.stderr
    assert "local-task" in proc.stderr and "libcuda" not in proc.stderr
    proc = run_gpudiag(["probe", "--backend", "iree:nosuch"], gpu_env())
    assert proc.returncode == 2 and "'nosuch'" in proc.stderr
    # A known driver this IREE build may lack gets a remediation that is not CUDA's alone.
    fix = BLOCKERS["iree_driver_unavailable"].remediation
    assert "install an IREE runtime built with it" in fix


def test_the_daemon_says_what_changed_in_its_verdict(fakes: FakeDriver, tmp_path: Path) -> None:
    state = tmp_path / "gpu-state"
    write_state_file(state, {"FAKE_NVML_DEVICE_COUNT": 2})
    env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_GPU_STATE_FILE=str(state))
    daemon = Daemon(env, write_config(tmp_path / "d.toml", daemon_toml()), tmp_path / "state")
    try:
        daemon.wait_ready()

        def changes() -> list[str]:
            return [m for m in (json.loads(line).get("msg", "") for line in list(daemon.lines)
                                if line.startswith("{")) if m.startswith("verdict changed")]

        write_state_file(state, {"FAKE_NVML_DEVICE_COUNT": 2, "FAKE_NVML_DEVICE_ERRORS": "1:15"})
        wait_for(lambda: any("gpu_lost" in m for m in changes()), 20, 0.1)
        # The text format says where the verdict came from and how old it is.
        text = run_gpudiag(["preflight", "--daemon-url", daemon.url], env)
        assert text.returncode == 1, text.stderr
        assert re.search(r"^host \S+, source daemon, (just now|\d+ s old) \(checked ",
                         text.stdout, re.M), text.stdout
        assert "lost" in _device_rows(text.stdout)[1]
        write_state_file(state, {"FAKE_NVML_DEVICE_COUNT": 2})
        wait_for(lambda: any("went: gpu_lost" in m for m in changes()), 20, 0.1)
    finally:
        daemon.stop()
    said = changes()
    # NVML reads no UUID of a lost GPU: the line names the one it last had (issue 30).
    last = "GPU 1 (last seen as GPU-f00d0001-0000-4000-8000-000000000001)"
    assert f"verdict changed: gpu_lost (appeared: gpu_lost on {last})" in said, said
    assert f"verdict changed: none (went: gpu_lost on {last})" in said, said


ROOT = Path(__file__).resolve().parents[1]


def _metric_names() -> set[str]:
    """Every metric family the daemon exports, as exposed (counters end in _total)."""
    family = re.compile(r"(Counter|Gauge|Info)MetricFamily\(\s*f?\"(gpudiag_[a-z_{}]+)\"")
    names: set[str] = set()
    for path in (ROOT / "gpudiag" / "daemon").glob("*.py"):
        for kind, name in family.findall(path.read_text()):
            suffix = {"Counter": "_total", "Info": "_info"}.get(kind, "")
            if "{k}" in name:
                names.update(name.replace("{k}", k) for k in ("total", "used", "free"))
            else:
                names.add(name + suffix)
    return names


def test_reference_states_every_contract_without_design_md() -> None:
    from gpudiag.core.catalog import WARNINGS

    reference = (ROOT / "docs" / "reference.md").read_text()
    for code in [*BLOCKERS, *WARNINGS]:
        assert f"`{code}`" in reference, code
    assert "(blockers.md)" in reference and "gpudiag.verdict/1" in reference
    for field in ("gpu_validation_blocker", "occupancy", "last_proven_at", "selected",
                  "memory_used_bytes", "pids", "age_s", "source"):
        assert f"`{field}`" in reference, field
    for endpoint in ("/metrics", "/v1/preflight", "/v1/health", "/v1/probe", "/v1/history",
                     "/healthz", "/readyz"):
        assert endpoint in reference, endpoint
    assert "## Exit codes" in reference and "125" in reference
    names = _metric_names()
    assert "gpudiag_http_rejected_total" in names and len(names) > 25
    daemon_md = (ROOT / "docs" / "daemon.md").read_text()
    for head, alts, tail in re.findall(r"\b(gpudiag_[a-z_]*)\{([a-z_,]+)\}([a-z_]*)", daemon_md):
        daemon_md += " ".join(head + alt + tail for alt in alts.split(","))  # brace forms
    for name in names:
        assert name in reference, name
        assert name in daemon_md, f"{name} missing from docs/daemon.md's metric table"
    docs = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "tests").rglob("*.py")]
    mentions = [p.name for p in docs if "DESIGN" + ".md" in p.read_text()]
    assert mentions == [], "refer to docs/reference.md, not a design brief outside the repository"


@pytest.mark.parametrize("recipe", ["healthy", "lost", "cuinit", "busy", "jax", "xids",
                                    "slurm"])
def test_every_try_without_a_gpu_recipe_runs_as_written(recipe: str, tmp_path: Path) -> None:
    from tests.support.host import clean_env

    blocks = doc_blocks()
    assert set(blocks) == {"setup", "healthy", "lost", "cuinit", "busy", "jax", "xids",
                           "slurm"}
    port = str(free_port())
    script = (blocks["setup"] + blocks[recipe]).replace("/tmp/gpudiag-try",
                                                       str(tmp_path / "try"))
    script = script.replace("19477", port)
    env = clean_env()
    env.pop("GPUDIAG_DAEMON_URL")  # as on a fresh machine (no daemon answers there)
    env.pop("GPUDIAG_LOCK_DIR")  # the recipe's environment brings its own
    env["COLUMNS"] = "100"
    # Its own session: whatever a recipe leaves running (a daemon, a job) ends with the test.
    # A trace of every command (bash -x, to a file) says where a recipe stopped if it hangs.
    trace = tmp_path / "trace.txt"
    env["BASH_XTRACEFD"] = "9"
    bash = subprocess.Popen(["bash", "-c", f"exec 9>{trace}; set -x\n" + script], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = bash.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        out, err = "", "timed out"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(bash.pid, signal.SIGKILL)
        bash.wait()
    proc = subprocess.CompletedProcess(bash.args, bash.returncode, out, err)
    log = tmp_path / "try" / "daemon.log"
    if log.exists():
        proc.stderr += log.read_text()[-3000:]
    if trace.exists():
        proc.stderr += "\ntrace (last commands):\n" + trace.read_text()[-1500:]
    expected = re.findall(r"^# -> (.*)$", blocks[recipe], re.M)
    assert expected
    for line in expected:
        assert line.replace("19477", port) in proc.stdout, (
            f"{line!r} not in the output of recipe {recipe}:\n{proc.stdout}\n{proc.stderr}")
    assert "Traceback" not in proc.stdout + proc.stderr


def test_the_fakes_command_prints_an_environment_that_shells_can_use(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "tests.fakes", str(tmp_path / "f"), "--gpus",
                           "4"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert "RuntimeWarning" not in proc.stderr  # the package's own entry point: no warning
    assert proc.stdout == (tmp_path / "f" / "env.sh").read_text()
    assert "export FAKE_NVML_DEVICE_COUNT=4" in proc.stdout.splitlines()
    assert len(list((tmp_path / "f" / "dev").glob("nvidia[0-9]*"))) == 4


def test_setup_says_what_it_is_doing() -> None:
    proc = subprocess.run(["scripts/setup.sh"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    if proc.returncode == 1 and "please install" in proc.stderr:
        pytest.skip("setup.sh needs root for the missing Debian packages here")
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith("setup: ")]
    assert said and said[-1].startswith("setup: done:")


def test_probe_and_preflight_list_backends_in_one_order(gpu_env: EnvFactory) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=2)
    _, probed = verdict_of(["probe", "--backend", "iree:local-task,cuda,host,nvml", "--json"],
                           env)
    _, pre = verdict_of(["preflight", "--no-daemon", "--require", "iree:local-task,cuda,nvml",
                         "--format", "json"], env)
    assert list(probed["backends"]) == ["host", "nvml", "cuda", "iree"]
    assert list(pre["backends"]) == ["host", "nvml", "cuda", "iree"]


def test_piped_text_has_no_trailing_spaces(gpu_env: EnvFactory) -> None:
    proc = run_gpudiag(["probe", "--backend", "host,nvml,cuda"], gpu_env(
        FAKE_NVML_DEVICE_ERRORS="1:15"))
    assert proc.stdout.endswith("gpu_validation_blocker=gpu_lost\n")
    assert [line for line in proc.stdout.splitlines() if line != line.rstrip()] == []


def test_uuid_prefixes_grow_until_unique_and_pci_keeps_a_nonzero_domain() -> None:
    from gpudiag.cli.render import cuda_version, short_pci, short_uuids

    a, b = "GPU-5f3a2b1c-1111-4000-8000-000000000001", "GPU-5f3a2b1c-1112-4000-8000-0000000000"
    short = short_uuids([a, b, None, "GPU-0badcafe-0000-4000-8000-000000000000"])
    assert short[a] == "GPU-5f3a2b1c-1111" and short[b] == "GPU-5f3a2b1c-1112"
    assert short["GPU-0badcafe-0000-4000-8000-000000000000"] == "GPU-0badcafe"
    assert short_pci("00000000:18:00.0") == "18:00.0"
    assert short_pci("00000001:18:00.0") == "0001:18:00.0"
    assert short_pci(None) == "-"
    assert (cuda_version("12080"), cuda_version(13000), cuda_version("n/a")) == (
        "12.8", "13.0", "n/a")


def test_device_records_from_older_and_newer_gpudiag_versions_are_read() -> None:
    from gpudiag.core.verdict import DeviceInfo

    old = {"index": 0, "uuid": "GPU-1", "name": "H200", "pci_bus_id": None,
           "memory_total_bytes": None, "memory_free_bytes": None}
    assert DeviceInfo.from_record(old).pids is None
    newer = {**DeviceInfo(0, "GPU-1", None, None, None, None, pids=(7,)).record(), "x": 1}
    assert DeviceInfo.from_record(newer).pids == (7,)
    with pytest.raises(TypeError):
        DeviceInfo.from_record({**old, "pids": ["7"]})
