"""An idle daemon's threads sleep until an event or their next deadline (issue 31).

Wakeups are counted from the kernel (/proc/self/task/TID/status context switches), not timed:
the HTTP selector used to wake five times a second and the XID watcher's supervisor five
times a second plus once per heartbeat. Each test also shows that the event or deadline the
loop sleeps for is still acted on.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gpudiag.daemon.config import XidConfig
from gpudiag.daemon.httpserver import AbuseLog, HttpServer
from gpudiag.daemon.watcher import XidWatcher
from tests.support.daemon import wait_for

WINDOW_S = 2.0


def _switches(tid: int) -> int:
    """Voluntary plus involuntary context switches of one thread of this process so far."""
    text = Path(f"/proc/self/task/{tid}/status").read_text()
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return int(fields["voluntary_ctxt_switches"]) + int(fields["nonvoluntary_ctxt_switches"])


def _wakeups_per_s(thread: threading.Thread, window_s: float = WINDOW_S) -> float:
    """How often ``thread`` woke per second over ``window_s``, counted by the kernel."""
    assert thread.native_id is not None
    before = _switches(thread.native_id)
    time.sleep(window_s)
    return (_switches(thread.native_id) - before) / window_s


def _app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def _serving(server: HttpServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    time.sleep(0.2)  # past its start
    return thread


def test_an_idle_http_listener_sleeps_instead_of_polling() -> None:
    server = HttpServer(_app, "127.0.0.1", 0)
    thread = _serving(server)
    try:
        # It used to wake every 0.2 s (5/s); now at most every IDLE_WAKE_S (5 s) when idle.
        assert _wakeups_per_s(thread) <= 1.0
        with socket.create_connection(("127.0.0.1", server.server_address[1])) as s:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            assert s.recv(4096).split(b" ", 2)[1] == b"200"  # an event still wakes it
    finally:
        server.shutdown()
    assert not thread.is_alive() or not server.serving


def test_the_sleeping_listener_still_answers_a_slow_client_at_its_head_deadline() -> None:
    server = HttpServer(_app, "127.0.0.1", 0, head_timeout_s=0.5)
    _serving(server)
    try:
        with socket.create_connection(("127.0.0.1", server.server_address[1])) as s:
            s.settimeout(10)
            s.sendall(b"GET / HTTP/1.1\r\n")  # never finishes its head
            started = time.monotonic()
            answer = s.recv(4096)
            waited = time.monotonic() - started
        assert b" 408 " in answer.split(b"\r\n", 1)[0]
        # Well before the idle wake (5 s): the loop slept until the head's own deadline.
        assert waited < 3.0
        assert server.abuse.totals["slow_client"] == 1
    finally:
        server.shutdown()


def test_abuse_counts_waiting_for_a_summary_set_the_listeners_next_wake() -> None:
    now = [100.0]
    abuse = AbuseLog(interval_s=60.0, clock=lambda: now[0])
    assert abuse.summary_in_s() is None  # nothing to summarise: no deadline
    abuse.note("busy", "a")  # the first of a kind is logged at once, not summarised
    assert abuse.summary_in_s() is None
    abuse.note("busy", "b")
    assert abuse.summary_in_s() == 60.0
    now[0] += 45.0
    assert abuse.summary_in_s() == 15.0
    now[0] += 30.0
    assert abuse.summary_in_s() == 0.0
    abuse.flush()
    assert abuse.summary_in_s() is None


HEARTBEATS_THEN_XID = """
import json, sys, time
def say(**m): print(json.dumps(m), flush=True)
say(type="hello", devices=[{"index": 0, "uuid": "GPU-a"}])
for _ in range(int(sys.argv[1])):
    time.sleep(1.0)
    say(type="heartbeat")
say(type="xid", xid=79, device_index=0, uuid="GPU-a")
time.sleep(60)
"""


def test_the_xid_supervisor_wakes_per_line_not_five_times_a_second(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(HEARTBEATS_THEN_XID)
    beats = 4
    watcher = XidWatcher(XidConfig(heartbeat_s=1.0, telemetry_s=5.0), {},
                         argv=[sys.executable, str(script), str(beats)])
    watcher.start()
    try:
        wait_for(lambda: watcher.state().running, 10)
        assert watcher._thread is not None
        # One heartbeat a second: about one wakeup each; it used to be six a second.
        assert _wakeups_per_s(watcher._thread, 2.5) <= 2.5
        # The XID after the heartbeats is handled as its line arrives, long before the
        # silence limit (8 s) the supervisor sleeps towards.
        state = wait_for(lambda: (s := watcher.state()).recent and s, 10, interval=0.05)
        assert [x.xid for x in state.recent] == [79] and state.restarts == 0
    finally:
        stopped = time.monotonic()
        watcher.stop()
    # stop() kills the child; its end wakes the sleeping supervisor at once.
    assert watcher._thread is not None and not watcher._thread.is_alive()
    assert time.monotonic() - stopped < 6.0  # not the 8 s silence limit it slept towards
