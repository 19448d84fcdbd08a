"""The node-problem-detector relay: ask the daemon the node-health question, keep NPD's answer.

``gpudiag npd-relay`` runs this in a sidecar of NPD's pod (gpudiag's image), so that NPD's own
container needs no gpudiag, no Python and no network: its plugin reads the status file this
writes (gpudiag.core.npd). The daemon is asked on its unix socket through the one client
(``engine.client.ask_daemon``: only a peer running as the daemon's user is believed, and the
answer is checked against the question), and only the daemon: probes run here would run in a
pod without the GPUs' driver and call a healthy node broken. No answer is Unknown.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import TextIO

from gpudiag.core import npd
from gpudiag.core.fileio import atomic_write
from gpudiag.core.limits import DEFAULT_DAEMON_WAIT_S
from gpudiag.core.redact import redact_text
from gpudiag.core.termsafe import terminal_safe
from gpudiag.core.verdict import Requirement
from gpudiag.engine.client import ask_daemon


def relay_once(url: str, requirement: Requirement, *, env: Mapping[str, str] | None = None,
               timeout_s: float = DEFAULT_DAEMON_WAIT_S) -> tuple[npd.NpdAnswer, str]:
    """NPD's answer from one question to the daemon, and why (``daemon`` or its reason).

    DaemonUrlError (from the client) for a URL or GPUDIAG_DAEMON_USER that is not understood.
    """
    answer = ask_daemon(url, requirement, env=os.environ if env is None else env,
                        read_timeout_s=timeout_s, say=False)
    if answer.verdict is None:
        return npd.without_answer(answer.reason, refused=answer.refused,
                                  untrusted=answer.untrusted), answer.reason
    return npd.from_verdict(answer.verdict), "daemon"


def write_status(path: str, answer: npd.NpdAnswer, written_at_s: float) -> None:
    """The status file, replaced atomically: the plugin reads the old answer or the new one."""
    atomic_write(path, npd.status_text(answer, written_at_s), mode=0o644)


def relay(url: str, requirement: Requirement, status_file: str, every_s: float, *,
          timeout_s: float = DEFAULT_DAEMON_WAIT_S, env: Mapping[str, str] | None = None,
          log: TextIO | None = None, rounds: int | None = None,
          clock: Callable[[], float] = time.time,
          sleep: Callable[[float], None] = time.sleep) -> None:
    """Ask every ``every_s`` seconds and rewrite ``status_file`` (``rounds``: stop after that
    many; None: until killed). One log line whenever the answer changes, with its reason; a
    status file that cannot be written is logged and tried again next round (the plugin then
    reads a stale answer: Unknown)."""
    out = sys.stderr if log is None else log
    last: tuple[npd.NpdAnswer, str] | None = None
    done = 0
    while rounds is None or done < rounds:
        started = time.monotonic()
        answer, why = relay_once(url, requirement, env=env, timeout_s=timeout_s)
        try:
            write_status(status_file, answer, clock())
            wrote = ""
        except OSError as e:
            wrote = f"; could not write {status_file}: {e.strerror or e}"
        if last is None or (answer, wrote) != last:
            reason = terminal_safe(redact_text(why), one_line=True)
            print(f"gpudiag npd-relay: {answer.message} (NPD exit {answer.exit_code}): "
                  f"{reason}{wrote}", file=out, flush=True)
            last = (answer, wrote)
        done += 1
        if rounds is None or done < rounds:
            sleep(max(0.0, every_s - (time.monotonic() - started)))
