"""`gpudiag clear`: the state-dir owner releases held XIDs; a GPU that still fails is blocked."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpudiag.daemon.clears import ClearPoller, ClearRequest, read_request, write_request
from gpudiag.daemon.config import XidConfig
from gpudiag.daemon.watcher import XidWatcher
from tests.fakes.build import FakeDriver, write_state_file
from tests.support.daemon import Daemon, daemon_toml, host_env, wait_for, write_config
from tests.support.host import run_gpudiag

UUID0 = "GPU-f00d0000-0000-4000-8000-000000000000"
UUID1 = "GPU-f00d0001-0000-4000-8000-000000000001"


# -- the request files and the poller ----------------------------------------------------------
class Applied:
    """Stand-ins for the watcher, the history and the scheduler, recording what they got."""

    def __init__(self) -> None:
        self.released: list[tuple[str | None, float]] = []
        self.recorded: list[tuple[ClearRequest, int]] = []
        self.rechecks = 0

    def release(self, gpu: str | None, before: float) -> int:
        self.released.append((gpu, before))
        return 2

    def record(self, request: ClearRequest, released: int) -> None:
        self.recorded.append((request, released))

    def recheck(self) -> None:
        self.rechecks += 1


def _poller(state: Path, applied: Applied, wall: float = 2e9) -> ClearPoller:
    poller = ClearPoller(state, release=applied.release, record=applied.record,
                         recheck=applied.recheck, wall=lambda: wall)
    poller.prepare()
    return poller


def test_a_request_is_applied_once_recorded_with_the_owners_uid_and_rechecked(
        tmp_path: Path) -> None:
    applied = Applied()
    poller = _poller(tmp_path, applied)
    assert oct(poller.folder.stat().st_mode & 0o777) == "0o700"
    write_request(tmp_path, UUID0, "reseated", now=lambda: 1000.0)
    write_request(tmp_path, None, "", now=lambda: 1001.0)
    done = poller.poll()
    assert [(r.gpu, r.reason, r.uid) for r in done] == [
        (UUID0, "reseated", os.getuid()), (None, "", os.getuid())]
    assert applied.released == [(UUID0, 1000.0), (None, 1001.0)]
    assert [n for _, n in applied.recorded] == [2, 2] and applied.rechecks == 1
    assert poller.poll() == [] and applied.rechecks == 1  # files are consumed
    assert list(poller.folder.iterdir()) == []


def test_a_request_from_the_future_releases_only_what_is_held_now(tmp_path: Path) -> None:
    applied = Applied()
    poller = _poller(tmp_path, applied, wall=500.0)
    write_request(tmp_path, UUID1, "x", now=lambda: 9e9)
    poller.poll()
    assert applied.released == [(UUID1, 500.0)]


@pytest.mark.parametrize(("body", "why"), [
    (b"not json", "not JSON"), (b"[1]", "not a JSON object"),
    (b'{"gpu": 7, "requested_wall": 1}', "gpu 7"),
    (b'{"gpu": null, "reason": 3, "requested_wall": 1}', "reason 3"),
    (b'{"gpu": null}', "requested_wall None"),
    (b"{}" + b" " * (64 * 1024), "larger than"),
])
def test_a_bad_request_is_refused_kept_aside_and_logged(tmp_path: Path, body: bytes, why: str,
                                                         caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    applied = Applied()
    poller = _poller(tmp_path, applied)
    (poller.folder / "1-1.json").write_bytes(body)
    with caplog.at_level(logging.WARNING, "gpudiag.daemon.clears"):
        assert poller.poll() == []
    assert applied.released == [] and applied.rechecks == 0
    assert (poller.folder / "1-1.json.rejected").read_bytes() == body
    assert why in caplog.text


def test_a_symlinked_request_is_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret.json"
    secret.write_text('{"gpu": null, "requested_wall": 1}')
    link = tmp_path / "link.json"
    link.symlink_to(secret)
    with pytest.raises(ValueError, match="cannot open"):
        read_request(link)


def test_a_folder_named_like_a_request_is_refused_not_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "1-1.json").mkdir()
    with pytest.raises(ValueError, match="not a regular file"):
        read_request(tmp_path / "1-1.json")


# -- the watcher releases held XIDs ------------------------------------------------------------
HELD = """
import json, time
def say(**m): print(json.dumps(m), flush=True)
say(type="hello", devices=[{"index": 0, "uuid": "GPU-a"}, {"index": 1, "uuid": "GPU-b"}])
say(type="xid", xid=79, device_index=0, uuid="GPU-a")
say(type="xid", xid=48, device_index=1, uuid="GPU-b")
while True:
    say(type="heartbeat"); time.sleep(0.1)
"""


def test_the_watcher_releases_the_held_xids_of_one_gpu_then_of_all(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(HELD)
    w = XidWatcher(XidConfig(heartbeat_s=0.1, telemetry_s=0.1), {},
                   argv=[sys.executable, str(script)])
    w.start()
    try:
        wait_for(lambda: len(w.state().recent) == 2, 10)
        assert w.clear("GPU-a", time.time() - 3600) == 0  # XIDs after the request stay
        assert w.clear("GPU-a", time.time()) == 1
        assert [x.uuid for x in w.state().recent] == ["GPU-b"]
        assert w.clear(None, time.time()) == 1 and w.state().recent == ()
        assert {c.xid for c in w.state().xid_counts} == {79, 48}  # the counters stay
    finally:
        w.stop()


# -- the CLI -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("args", "says"), [
    ([], "exactly one of --gpu GPU or --all"),
    (["--all", "--gpu", UUID0], "exactly one of"),
    (["--gpu", "GPU-f00d"], "not a full GPU UUID and there is no daemon history"),
    (["--gpu", "0"], "not a full GPU UUID and there is no daemon history"),
])
def test_clear_refuses_bad_flags(args: list[str], says: str, tmp_path: Path) -> None:
    proc = run_gpudiag(["clear", *args, "--state-dir", str(tmp_path)], os.environ)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr


def test_clear_needs_the_daemons_state_dir(tmp_path: Path) -> None:
    proc = run_gpudiag(["clear", "--all", "--state-dir", str(tmp_path / "nope")], os.environ)
    assert proc.returncode == 2 and "no daemon state directory" in proc.stderr


def test_a_user_who_cannot_write_the_state_dir_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    prefix: list[str] = []
    if os.geteuid() == 0:
        # Root writes anywhere; in a user namespace a folder owned by an unmapped uid is
        # someone else's, as for any user who is not the daemon's.
        if shutil.which("unshare") is None:
            pytest.skip("unshare is not installed, so root cannot be made an ordinary user")
        os.chown(state, 12345, 12345)
        prefix = ["unshare", "--user", "--map-root-user"]
    state.chmod(0o755)
    proc = subprocess.run([*prefix, sys.executable, "-m", "gpudiag", "clear", "--gpu", UUID0,
                           "--reason", "reseated", "--state-dir", str(state)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "cannot write the daemon's state directory" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (state / "clear-requests").exists()


# -- end to end: a real daemon on the fakes ----------------------------------------------------
def _blockers(daemon: Daemon) -> list[dict[str, Any]]:
    status, rec = daemon.get("/v1/preflight?require=cuda")
    assert status == 200, rec
    return list(rec["blockers"])


def test_clear_releases_held_xids_and_a_gpu_that_still_fails_is_blocked_again(
        fakes: FakeDriver, tmp_path: Path) -> None:
    state_file = tmp_path / "gpu-state"
    knobs: dict[str, str | int] = {"FAKE_NVML_DEVICE_COUNT": 2, "FAKE_NVML_XIDS": "0:48,1:74"}
    write_state_file(state_file, knobs)
    env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_GPU_STATE_FILE=str(state_file))
    # NVML is probed rarely here: what the clear's own re-probe sees shows within seconds.
    toml = daemon_toml({"backends.nvml": {"interval_s": 600}})
    state = tmp_path / "state"
    daemon = Daemon(env, write_config(tmp_path / "gpudiag.toml", toml), state)
    try:
        daemon.wait_ready()
        held = wait_for(lambda: len(b := [x for x in _blockers(daemon) if "XID" in x["message"]])
                        == 2 and b, 15, interval=0.1)
        assert {b["code"] for b in held} == {"gpu_reset_required"}
        # GPU 1 was not repaired: NVML now says it needs a reset (seen at the next probe).
        write_state_file(state_file, {**knobs, "FAKE_NVML_DEVICE_ERRORS": "1:16"})
        proc = run_gpudiag(["clear", "--all", "--reason", "reset both GPUs",
                            "--state-dir", str(state)], env)
        assert proc.returncode == 0, proc.stderr
        def released() -> list[dict[str, Any]] | None:
            # GPU 1's occupancy can read UNKNOWN (device_state_unknown) before the clear's
            # re-probe says why: wait for the probe's word.
            now = _blockers(daemon)
            return now if now and not any("XID" in b["message"] for b in now) and any(
                b["code"] == "gpu_reset_required" for b in now) else None

        after = wait_for(released, 15, interval=0.1)
        assert [(b["code"], b["device"]) for b in after] == [
            ("gpu_reset_required", after[0]["device"])]
        assert "(16)" in after[0]["message"] and "1" in after[0]["message"]
        hist = run_gpudiag(["history", "--json", "--state-dir", str(state)], env)
        clears = json.loads(hist.stdout)["clears"]
        assert [(c["uid"], c["gpu"], c["reason"], c["released_xids"]) for c in clears] == [
            (os.getuid(), None, "reset both GPUs", 2)]
        status, api = daemon.get("/v1/history")
        assert status == 200 and [c["reason"] for c in api["clears"]] == ["reset both GPUs"]
        text = run_gpudiag(["history", "--state-dir", str(state)], env).stdout
        assert "all GPUs  by uid" in text and "reset both GPUs" in text
        assert any("cleared by uid" in line for line in daemon.lines)
    finally:
        assert daemon.stop() == 0


def test_clear_names_a_gpu_by_index_uuid_prefix_or_pci_bus_id_as_nvidia_smi_does(
        fakes: FakeDriver, tmp_path: Path) -> None:
    state_file = tmp_path / "gpu-state"
    knobs: dict[str, str | int] = {"FAKE_NVML_DEVICE_COUNT": 4,
                                   "FAKE_NVML_XIDS": "1:79,2:79,3:79"}
    write_state_file(state_file, {"FAKE_NVML_DEVICE_COUNT": 4})
    env = host_env(fakes, tmp_path / "host", gpus=4, FAKE_GPU_STATE_FILE=str(state_file))
    state = tmp_path / "state"
    daemon = Daemon(env, write_config(tmp_path / "gpudiag.toml", daemon_toml({})), state)
    try:
        daemon.wait_ready()
        write_state_file(state_file, knobs)
        wait_for(lambda: len([b for b in _blockers(daemon) if "XID" in b["message"]]) == 3,
                 15, interval=0.1)
        write_state_file(state_file, {"FAKE_NVML_DEVICE_COUNT": 4})
        uuids = [f"GPU-f00d{i:04x}-0000-4000-8000-{i:012x}" for i in range(4)]
        for selector, index in [("1", 1), ("gpu-F00D0002", 2), ("0000:1b:00.0", 3)]:
            proc = run_gpudiag(["clear", "--gpu", selector, "--reason", f"fixed {index}",
                                "--state-dir", str(state)], env)
            assert proc.returncode == 0, proc.stderr
            assert f"clear of {uuids[index]} requested" in proc.stdout
            assert ".json" not in proc.stdout  # no internal file name
        for selector, says in [("GPU-f00d", "names 4 GPUs"), ("9", "no GPU named '9'; GPUs here"),
                               ("00:99:00.0", "no GPU named '00:99:00.0'")]:
            proc = run_gpudiag(["clear", "--gpu", selector, "--state-dir", str(state)], env)
            assert proc.returncode == 2 and says in proc.stderr, proc.stderr
            assert "Traceback" not in proc.stderr
        assert uuids[3] in proc.stderr and "00000000:1B:00.0" in proc.stderr  # what it knows
        wait_for(lambda: not any("XID" in b["message"] for b in _blockers(daemon)), 15,
                 interval=0.1)
        hist = run_gpudiag(["history", "--json", "--state-dir", str(state)], env)
        clears = json.loads(hist.stdout)["clears"]
        assert sorted((c["gpu"], c["reason"]) for c in clears) == [
            (uuids[i], f"fixed {i}") for i in (1, 2, 3)]
    finally:
        assert daemon.stop() == 0
