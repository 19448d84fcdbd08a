"""Slurm as remediation sees it: ``scontrol`` and ``sinfo`` run with a deadline, parsed once.

The executables and SLURM_CONF come from the daemon's config ([remediation]), never from the
environment: the children get a fixed PATH and C locale only. Each call runs in its own
session and its whole process group is killed at the deadline, so a hung scontrol (a
slurmctld that does not answer) costs at most ``timeout_s``. Every failure is a SlurmError
whose ``kind`` (absent, timeout, failed, unknown_node, unparsable) is the metric's label.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import time
from collections.abc import Callable, Sequence

from gpudiag.core.remediation import Fleet, NodeView, is_gpudiag_reason
from gpudiag.core.remediation_config import RemediationConfig
from gpudiag.daemon.actuator import ActuatorError, ActuatorSpec, NodeInfo

CHILD_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
OUTPUT_LIMIT = 1 << 20
_FIELD = r"(?:^|\s){key}=(\S*)"
_REASON = re.compile(r"^\s*Reason=(.*?)(?: \[[^]]*\])?\s*$", re.M)


class SlurmError(ActuatorError):
    """scontrol or sinfo could not answer; ``kind`` says how."""


def parse_show_node(text: str) -> NodeInfo:
    """The State, Reason and Partitions fields of ``scontrol show node`` (Slurm 22.05+)."""
    state = re.search(_FIELD.format(key="State"), text, re.M)
    if state is None:
        raise SlurmError("unparsable", f"no State= in scontrol's answer: {text[:200]!r}")
    reason = _REASON.search(text)
    parts = re.search(_FIELD.format(key="Partitions"), text, re.M)
    partitions = tuple(p for p in (parts.group(1).split(",") if parts else ()) if p)
    return NodeInfo(NodeView(state.group(1), reason.group(1).strip() if reason else ""),
                    partitions)


def parse_fleet(text: str, *, node: str, now_wall: float, window_s: float) -> Fleet:
    """``sinfo -h -N -o '%N|%H|%E'``: the partition's nodes, and how many others carry a
    gpudiag reason set within the window (an unreadable time counts as recent: refusing a
    drain is the safe side)."""
    nodes: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        name, _, rest = line.strip().partition("|")
        when, _, reason = rest.partition("|")
        if name:
            nodes[name] = (when.strip(), reason.strip())
    recent = 0
    for name, (when, reason) in nodes.items():
        if name == node or not is_gpudiag_reason(reason):
            continue
        try:
            set_wall = time.mktime(time.strptime(when, "%Y-%m-%dT%H:%M:%S"))
        except ValueError:
            set_wall = now_wall
        if now_wall - set_wall <= window_s:
            recent += 1
    return Fleet(nodes=len(nodes), recent_own=recent)


Runner = Callable[[Sequence[str], dict[str, str], float], tuple[int, str, str]]


def run_bounded(argv: Sequence[str], env: dict[str, str], timeout_s: float
                ) -> tuple[int, str, str]:
    """Run ``argv`` (no shell) in its own session; kill its group at the deadline."""
    try:
        proc = subprocess.Popen(  # noqa: S603 - argv from the root-owned config, no shell
            list(argv), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
    except OSError as e:
        raise SlurmError("absent", f"cannot run {argv[0]}: {e.strerror or e}") from e
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.communicate()
        raise SlurmError("timeout", f"{argv[0]} {argv[1] if len(argv) > 1 else ''} did not "
                         f"answer within {timeout_s:g} s") from None
    return (proc.returncode, out[:OUTPUT_LIMIT].decode(errors="replace"),
            err[-4096:].decode(errors="replace"))


def check_executable(path: str) -> str | None:
    """Why ``path`` must not be run by a root daemon (None: it may): not a regular file, not
    executable, or writable by someone other than its owner (who could swap the code)."""
    try:
        st = os.stat(path)
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    if not stat.S_ISREG(st.st_mode) or not st.st_mode & 0o111:
        return f"{path} is not an executable file"
    if st.st_mode & 0o022:
        return f"{path} is writable by its group or by everyone (mode {st.st_mode & 0o777:o})"
    return None


class SlurmControl:
    """The few Slurm calls remediation makes, for one node."""

    def __init__(self, *, scontrol: str, sinfo: str, node: str, slurm_conf: str | None,
                 timeout_s: float, runner: Runner = run_bounded) -> None:
        self.scontrol, self.sinfo, self.node = scontrol, sinfo, node
        self.timeout_s = timeout_s
        self._runner = runner
        self._env = {"PATH": CHILD_PATH, "LC_ALL": "C"}
        if slurm_conf:
            self._env["SLURM_CONF"] = slurm_conf

    def _run(self, argv: list[str]) -> str:
        code, out, err = self._runner(argv, dict(self._env), self.timeout_s)
        if code != 0:
            # scontrol says "cannot reach slurmctld" over several lines: one log line each.
            text = "; ".join(line.strip() for line in (err or out).splitlines()
                             if line.strip())[-500:]
            kind = "unknown_node" if re.search(r"not found|Invalid node name", text) else "failed"
            raise SlurmError(kind, f"{os.path.basename(argv[0])} {argv[1]} exited {code}: "
                             f"{text or 'no message'}")
        return out

    def show_node(self) -> NodeInfo:
        """The node's state, reason and partitions."""
        return parse_show_node(self._run([self.scontrol, "show", "node", self.node]))

    def drain(self, reason: str) -> None:
        """Drain (running jobs finish; nothing new is placed) with ``reason``."""
        self._run([self.scontrol, "update", f"nodename={self.node}", "state=drain",
                   f"reason={reason}"])

    def resume(self) -> None:
        self._run([self.scontrol, "update", f"nodename={self.node}", "state=resume"])

    def fleet(self, partitions: Sequence[str], *, now_wall: float, window_s: float) -> Fleet:
        """The fleet guard's count over ``partitions`` (every node of them)."""
        argv = [self.sinfo, "--noheader", "--Node", "--format=%N|%H|%E"]
        if partitions:
            argv.append(f"--partition={','.join(partitions)}")
        return parse_fleet(self._run(argv), node=self.node, now_wall=now_wall,
                           window_s=window_s)


def _control(cfg: RemediationConfig, node: str) -> SlurmControl:
    """scontrol and sinfo as the config names them, for this node."""
    return SlurmControl(scontrol=cfg.scontrol, sinfo=cfg.sinfo, node=node,
                        slurm_conf=cfg.slurm_conf, timeout_s=cfg.command_timeout_s)


def _unsafe(cfg: RemediationConfig) -> str | None:
    """The first configured executable that exists and must not be run as the daemon."""
    return next((why for path in (cfg.scontrol, cfg.sinfo)
                 if (why := check_executable(path)) is not None and os.path.exists(path)), None)


SPEC = ActuatorSpec("slurm", "Slurm", make=_control, unsafe=_unsafe)
