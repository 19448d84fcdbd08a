"""A run's side of its one channel to its daemon: ``POST /v1/runs/begin``, ``/v1/runs/end``
and ``/v1/runs/blocked``, on the daemon's unix socket.

``gpudiag run`` announces itself to the daemon it asked once its GPUs are locked, passing the
descriptors of its GPU locks with the request (SCM_RIGHTS): the daemon asks the kernel which
locks those very open files hold, which needs no pid and so holds across pid namespaces (a
run in a container, a daemon without the host's). It hands its closeout over there at its
end, and a refused run says so there (daemon/runs.py says what the daemon takes from the
kernel and what from the run). Over TCP the daemon cannot see who asks and refuses; the run
then reports into the inbox as before, unattested.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from gpudiag.engine.client import daemon_post
from gpudiag.engine.wire import DaemonUrlError

# What the daemon reads of a run's body (httpparse.MAX_BODY_BYTES): the run's own word.
MAX_BODY_BYTES = 4096


def begin_run(url: str, gpus: Sequence[str], slurm_job_id: str | None,
              env: Mapping[str, str], lock_fds: Sequence[int] = ()) -> tuple[str | None, str]:
    """The run id the daemon at ``url`` attested, or None and why not. ``lock_fds``: the
    run's GPU lock descriptors, passed to the daemon for the kernel's word on what they hold
    (a daemon older than this asks the kernel by the run's pid instead)."""
    params = {"gpus": ",".join(gpus)}
    if slurm_job_id:
        params["slurm_job_id"] = slurm_job_id
    try:
        reply = daemon_post(url, "/v1/runs/begin", params, env=env, fds=lock_fds)
    except DaemonUrlError as e:
        return None, str(e)
    run = reply.data.get("run") if isinstance(reply.data, dict) else None
    if reply.status != 200 or not isinstance(run, str):
        return None, reply.why
    return run, ""


def end_body(argv: Sequence[str], closeout: str | None, gpu_usage: Sequence[Any]) -> bytes:
    """The run's word at its end, within the daemon's body limit (usage, then argv dropped
    when they do not fit)."""
    for rec in ({"argv": list(argv), "closeout": closeout, "gpu_usage": list(gpu_usage)},
                {"argv": list(argv), "closeout": closeout},
                {"argv": [a[:200] for a in argv[:8]], "closeout": closeout},
                {"closeout": closeout}):
        body = json.dumps(rec, separators=(",", ":"), default=str).encode()
        if len(body) <= MAX_BODY_BYTES:
            return body
    return b"{}"


def end_run(url: str, run_id: str, exit_code: int, child_pid: int, body: bytes,
            env: Mapping[str, str]) -> tuple[dict[str, Any] | None, str]:
    """The daemon's answer to the run's end (its window and attribution), or None and why."""
    params = {"run": run_id, "exit_code": str(exit_code), "child_pid": str(child_pid)}
    try:
        reply = daemon_post(url, "/v1/runs/end", params, body=body, env=env)
    except DaemonUrlError as e:
        return None, str(e)
    if reply.status != 200 or not isinstance(reply.data, dict):
        return None, reply.why
    return reply.data, ""


def block_run(url: str, code: str, codes: Sequence[str], slurm_job_id: str | None,
              env: Mapping[str, str]) -> tuple[bool, str]:
    """Tell the daemon at ``url`` that it refused this run before its start (its
    ``gpudiag_preflight_blocks_total``); whether it was counted, and why not."""
    params = {"code": code, "codes": ",".join(codes)}
    if slurm_job_id:
        params["slurm_job_id"] = slurm_job_id
    try:
        reply = daemon_post(url, "/v1/runs/blocked", params, env=env)
    except DaemonUrlError as e:
        return False, str(e)
    if reply.status != 200:
        return False, reply.why
    return True, ""
