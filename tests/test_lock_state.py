"""Whether a GPU's lock is held is the kernel's O(1) answer (engine/locks.lock_state), valid in
any pid namespace; the kernel's global table (/proc/locks) only names a holder, within a
deadline and a size bound; admission waits for a lock in the kernel (wait_for_free).

Holders are real processes holding real flocks; the pid-namespace tests use `unshare`.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from gpudiag.core.readiness import BUSY, FREE, UNKNOWN, GpuOccupancy
from gpudiag.engine import locks, occupancy_view
from gpudiag.engine.locks import (
    JOB_LOCKED,
    LOCK_EXCLUSIVE,
    LOCK_FREE,
    LOCK_SHARED,
    LockFailed,
    holders,
    lock_state,
    locked_by,
    read_lock_table,
    release,
    try_lock,
    wait_for_free,
)
from gpudiag.engine.occupancy_view import HELD_UNNAMED, SHARED_LOCKED, relook

UUID = "GPU-f00d0000-0000-4000-8000-000000000000"
HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_SH if sys.argv[2] == "shared" else fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[3]))
"""


def _hold(path: Path, mode: str, hold_s: float = 60.0,
          prefix: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    path.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([*prefix, sys.executable, "-c", HOLD, str(path), mode,
                             str(hold_s)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held", f"holder exited {proc.wait()}"
    return proc


@pytest.fixture
def lock_file(tmp_path: Path) -> Path:
    return tmp_path / f"{UUID}.lock"


@pytest.fixture
def holder_procs() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def _marked(lock_dir: Path, occupancy: Mapping[str, GpuOccupancy]) -> dict[str, GpuOccupancy]:
    """The one view's lock answer over ``occupancy`` (engine/occupancy_view.relook)."""
    return dict(relook(occupancy, occupancy, lock_dir=lock_dir).gpus)


def test_a_lock_file_that_does_not_exist_or_nobody_holds_is_free(tmp_path: Path) -> None:
    assert lock_state(tmp_path, UUID) == LOCK_FREE
    lk = try_lock(tmp_path, UUID)
    assert lk is not None
    release([lk])
    assert lock_state(tmp_path, UUID) == LOCK_FREE


@pytest.mark.parametrize(("mode", "state"), [("exclusive", LOCK_EXCLUSIVE),
                                             ("shared", LOCK_SHARED)])
def test_another_process_s_lock_reads_as_held_and_the_test_leaves_nothing_held(
        tmp_path: Path, lock_file: Path, holder_procs: list[subprocess.Popen[str]],
        mode: str, state: str) -> None:
    holder_procs.append(_hold(lock_file, mode))
    assert lock_state(tmp_path, UUID) == state
    holder_procs[0].kill()
    holder_procs[0].wait()
    lk = try_lock(tmp_path, UUID)  # the test itself let go at once
    assert lk is not None
    release([lk])


def test_a_planted_fifo_is_refused_not_read_as_free(tmp_path: Path, lock_file: Path) -> None:
    os.mkfifo(lock_file)
    with pytest.raises(LockFailed, match="not a plain regular file"):
        lock_state(tmp_path, UUID)


def test_the_table_too_large_or_too_slow_names_nobody(tmp_path: Path) -> None:
    table = tmp_path / "locks"
    table.write_text("1: FLOCK  ADVISORY  WRITE 4242 fe:00:2146312 0 EOF\n" * 1000)
    assert read_lock_table(table) is not None and len(read_lock_table(table) or []) == 1000
    assert read_lock_table(table, limit=1000) is None
    ticks = iter([0.0, 100.0, 200.0])
    assert read_lock_table(table, deadline_s=1.0, clock=lambda: next(ticks)) is None


def test_a_held_lock_whose_holder_cannot_be_named_is_busy_never_free(
        tmp_path: Path, lock_file: Path, holder_procs: list[subprocess.Popen[str]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    other = "GPU-f00d0001-0000-4000-8000-000000000001"
    view = {u: GpuOccupancy(u, FREE) for u in (UUID, other)}
    monkeypatch.setattr(occupancy_view, "kernel_locks", lambda: None)  # a table past its bounds
    holder_procs.append(_hold(lock_file, "exclusive"))
    marked = _marked(tmp_path, view)
    assert marked[UUID].state == BUSY and marked[UUID].why == JOB_LOCKED
    assert marked[other].state == FREE  # nobody holds it: no table needed to say so
    holder_procs.pop().kill()
    holder_procs.append(_hold(lock_file, "shared"))
    marked = _marked(tmp_path, view)
    assert marked[UUID].state == BUSY and marked[UUID].why == SHARED_LOCKED  # no probe mark
    # A probe mark held too: the holder might be a sibling probe, which only a name says.
    holder_procs.append(_hold(lock_file.with_suffix(".probing"), "shared"))
    marked = _marked(tmp_path, view)
    assert marked[UUID].state == BUSY and marked[UUID].why == HELD_UNNAMED


def test_a_free_gpu_costs_no_reading_of_the_kernel_s_table(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def never() -> None:
        raise AssertionError("the kernel's table was read for a lock nobody holds")

    monkeypatch.setattr(occupancy_view, "kernel_locks", never)
    monkeypatch.setattr(locks, "kernel_locks", never)
    lk = try_lock(tmp_path, UUID)
    assert lk is not None
    release([lk])
    marked = _marked(tmp_path, {UUID: GpuOccupancy(UUID, FREE)})
    assert marked[UUID].state == FREE
    assert holders(tmp_path, UUID) == []


def test_a_planted_lock_file_makes_its_gpu_unknown_in_the_daemon_s_view(
        tmp_path: Path, lock_file: Path) -> None:
    os.mkfifo(lock_file)
    marked = _marked(tmp_path, {UUID: GpuOccupancy(UUID, FREE)})
    assert marked[UUID].state == UNKNOWN


def test_waiting_for_a_lock_ends_in_the_kernel_when_its_holder_lets_go(
        tmp_path: Path, lock_file: Path, holder_procs: list[subprocess.Popen[str]]) -> None:
    holder_procs.append(_hold(lock_file, "exclusive", hold_s=0.5))
    t0 = time.monotonic()
    assert wait_for_free(tmp_path, [UUID], 10.0) == UUID
    assert 0.2 < time.monotonic() - t0 < 5.0
    lk = try_lock(tmp_path, UUID)  # the waiter took nothing
    assert lk is not None
    release([lk])


def test_waiting_for_a_lock_still_held_gives_up_at_its_timeout(
        tmp_path: Path, lock_file: Path, holder_procs: list[subprocess.Popen[str]]) -> None:
    holder_procs.append(_hold(lock_file, "exclusive"))
    t0 = time.monotonic()
    assert wait_for_free(tmp_path, [UUID], 0.3) is None
    assert time.monotonic() - t0 < 10  # the holder holds for ever: it gave up
    assert lock_state(tmp_path, UUID) == LOCK_EXCLUSIVE


def test_a_lock_nobody_holds_ends_the_wait_at_once(tmp_path: Path) -> None:
    assert wait_for_free(tmp_path, [UUID], 5.0) == UUID  # no file at all
    fd = os.open(tmp_path / f"{UUID}.lock", os.O_RDONLY | os.O_CREAT, 0o644)
    os.close(fd)
    assert wait_for_free(tmp_path, [UUID], 5.0) == UUID


NAMED = """
import json, sys
from pathlib import Path
from gpudiag.engine.locks import holders, lock_state
found = holders(Path(sys.argv[1]), sys.argv[2])
print(json.dumps({"state": lock_state(Path(sys.argv[1]), sys.argv[2]),
                  "holders": None if found is None else [h.describe() for h in found]}))
"""


def _unshare_pid() -> tuple[str, ...]:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a pid namespace")
    return ("unshare", "--pid", "--fork", "--mount-proc", "--kill-child")


def test_a_reader_in_its_own_pid_namespace_sees_a_host_lock_held_and_says_where(
        tmp_path: Path) -> None:
    prefix = _unshare_pid()
    lk = try_lock(tmp_path, UUID)
    assert lk is not None
    try:
        out = subprocess.run([*prefix, sys.executable, "-c", NAMED, str(tmp_path), UUID],
                             capture_output=True, text=True, timeout=60, check=True)
    finally:
        release([lk])
    seen = json.loads(out.stdout)
    assert seen["state"] == LOCK_EXCLUSIVE
    assert seen["holders"] == ["a process in another pid namespace (exclusive)"]


def test_a_lock_held_in_another_pid_namespace_is_busy_to_the_host_s_view(
        tmp_path: Path, lock_file: Path, holder_procs: list[subprocess.Popen[str]]) -> None:
    holder_procs.append(_hold(lock_file, "exclusive", prefix=_unshare_pid()))
    marked = _marked(tmp_path, {UUID: GpuOccupancy(UUID, FREE)})
    assert marked[UUID].state == BUSY


def test_the_o1_test_holding_a_lock_for_an_instant_never_refuses_a_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job's own non-blocking attempt that meets another reader's test is tried again."""
    from gpudiag.engine import guard
    real = locks.try_lock
    met: list[str] = []

    def raced(lock_dir: Path, uuid: str, **kw: object) -> object:
        if not met:  # the first attempt meets another reader's test holding it
            met.append(uuid)
            return None
        return real(lock_dir, uuid, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(guard, "try_lock", raced)
    with guard.claim_free({UUID: GpuOccupancy(UUID, FREE)}, [UUID],
                          lock_dir=tmp_path) as claim:
        assert claim.claimed == (UUID,), claim.left_alone
    assert met == [UUID]


def test_flock_test_on_a_description_we_hold_ourselves_reads_as_held(tmp_path: Path) -> None:
    lk = try_lock(tmp_path, UUID)
    assert lk is not None
    try:
        assert lock_state(tmp_path, UUID) == LOCK_EXCLUSIVE
        fcntl.flock(lk.fd, fcntl.LOCK_SH)  # ours, shared now
        assert lock_state(tmp_path, UUID) == LOCK_SHARED
    finally:
        release([lk])


def test_which_process_holds_a_lock_is_read_from_its_own_descriptors_not_the_table(
        tmp_path: Path, lock_file: Path, holder_procs: list[subprocess.Popen[str]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    def never() -> None:
        raise AssertionError("the kernel's global table was read")

    monkeypatch.setattr(locks, "kernel_locks", never)
    holder_procs.append(_hold(lock_file, "exclusive"))
    job = holder_procs[0].pid
    assert locked_by(tmp_path, UUID, job)
    assert not locked_by(tmp_path, UUID, os.getpid())  # held, but not by us
    holder_procs.pop().kill()
    holder_procs.append(_hold(lock_file, "shared"))
    assert not locked_by(tmp_path, UUID, holder_procs[0].pid)  # a shared lock is no job's


# --- many probes at once (round 5's CI failure: 16 commands together read devices_busy) ------

HOLD_MARKED = """
import fcntl, os, sys, time
for path in sys.argv[1:3]:  # the probe mark first, then the GPU's lock: as a probe holds them
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
print("held", flush=True)
time.sleep(60)
"""


def test_a_sibling_whose_mark_a_table_reading_skipped_is_still_named_probing(
        tmp_path: Path, lock_file: Path, holder_procs: list[subprocess.Popen[str]]) -> None:
    """/proc/locks is read a page at a time and its walk restarts at each page: an entry can
    be skipped while other locks come and go. The holder's own descriptors then say it."""
    mark = lock_file.with_suffix(".probing")
    proc = subprocess.Popen([sys.executable, "-c", HOLD_MARKED, str(mark), str(lock_file)],
                            stdout=subprocess.PIPE, text=True)
    holder_procs.append(proc)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    table = read_lock_table()
    assert table is not None
    skipped = [lk for lk in table if lk.inode != mark.stat().st_ino]
    assert len(skipped) < len(table), "the mark was not in the table to skip"
    found = holders(tmp_path, UUID, table=skipped)
    assert found is not None and [(h.pid, h.probing) for h in found] == [(proc.pid, True)]
    assert locks.holds_probe_mark(tmp_path, UUID, proc.pid)
    assert not locks.holds_probe_mark(tmp_path, UUID, os.getpid())


def test_a_probe_takes_its_mark_even_when_a_reader_s_instant_test_is_preempted(
        tmp_path: Path) -> None:
    """Another reader's O(1) look holds a mark exclusively for its moment, longer when it is
    preempted on a loaded host: the probe waits that out instead of going unmarked (and so
    looking like a job to its siblings)."""
    mark = tmp_path / f"{UUID}.probing"
    tmp_path.mkdir(exist_ok=True)
    reader = os.open(mark, os.O_RDONLY | os.O_CREAT, 0o644)
    fcntl.flock(reader, fcntl.LOCK_EX)
    letter = threading.Timer(0.1, os.close, args=(reader,))  # the reader runs again
    letter.start()
    try:
        lk = try_lock(tmp_path, UUID, purpose="probe", shared=True)
        assert lk is not None and lk.mark is not None
        release([lk])
    finally:
        letter.join()


def test_a_table_reading_begun_before_the_question_never_answers_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A reading one caller gave up on is joined by the next only if it began after that
    caller asked: an older one may list holders gone since and miss the ones come since."""
    gate = threading.Event()
    readings: list[int] = []

    def read(path: Path, **_: object) -> list[locks.KernelLock]:
        readings.append(len(readings))
        if len(readings) == 1:
            gate.wait(10)  # the first reading is slow (a loaded host)
        return []

    monkeypatch.setattr(locks, "read_lock_table", read)
    reader = locks._TableReader()
    assert reader.read(0.05) is None  # the first caller gives up
    threading.Timer(0.1, gate.set).start()
    assert reader.read(5.0) == []
    assert readings == [0, 1], "the second caller was answered by the older reading"


def test_a_holder_that_let_go_while_named_is_named_again_not_taken_for_a_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpudiag.engine import guard
    other = locks.Holder(None, (), True, None, False)  # listed, gone when looked at
    answers: list[list[locks.Holder]] = [[other], []]
    monkeypatch.setattr(guard, "holders", lambda *_a, **_k: answers.pop(0))
    monkeypatch.setattr(guard, "lock_state", lambda *_a: LOCK_SHARED)
    with guard.claim_free({UUID: GpuOccupancy(UUID, FREE)}, [UUID], lock_dir=tmp_path,
                          sibling_wait_s=5.0) as claim:
        assert claim.claimed == (UUID,), claim.left_alone
    assert answers == []
