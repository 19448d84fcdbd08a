"""A run's side of its attested window: ``POST /v1/runs/begin`` and ``/v1/runs/end``.

``gpudiag run`` announces itself to the daemon it asked, on its unix socket, once its GPUs
are locked, and hands its closeout over there at its end (daemon/runs.py says what the
daemon takes from the kernel and what from the run). Over TCP the daemon cannot see who asks
and refuses; the run then reports into the inbox as before, unattested.
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
              env: Mapping[str, str]) -> tuple[str | None, str]:
    """The run id the daemon at ``url`` attested, or None and why not."""
    params = {"gpus": ",".join(gpus)}
    if slurm_job_id:
        params["slurm_job_id"] = slurm_job_id
    try:
        reply = daemon_post(url, "/v1/runs/begin", params, env=env)
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
