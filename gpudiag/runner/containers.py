"""``gpudiag run --image``: one ``docker run`` with the admitted GPUs and the exact environment.

GPUs go in as CDI devices by full UUID when the Docker daemon lists them (``docker info``
DiscoveredDevices), else as ``--gpus all`` confined by the full-UUID CUDA_VISIBLE_DEVICES.
One way or the other, never both, never a retry the other way.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence

from gpudiag.core.records import dataclass

DOCKER_INFO_TIMEOUT_S = 10.0
CDI_KIND = "nvidia.com/gpu"


@dataclass(frozen=True)
class DockerPlan:
    """The argv of the one ``docker run`` and how the GPUs were injected."""

    argv: tuple[str, ...]
    injection: str  # "cdi" | "gpus-all" | "none"
    discovered: tuple[str, ...]  # CDI device ids the daemon listed
    info_error: str | None = None

    def record(self) -> dict[str, object]:
        return {"argv": list(self.argv), "injection": self.injection,
                "discovered": list(self.discovered), "info_error": self.info_error}


def discovered_devices(docker: str = "docker") -> tuple[tuple[str, ...], str | None]:
    """CDI device ids from ``docker info`` (empty, with the reason, when none are listed)."""
    argv = [docker, "info", "--format", "{{json .DiscoveredDevices}}"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True,  # noqa: S603 - no shell
                              timeout=DOCKER_INFO_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return (), f"{' '.join(argv)}: {e}"
    if proc.returncode != 0:
        return (), f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()[-500:]}"
    try:
        value = json.loads(proc.stdout.strip() or "null")
    except json.JSONDecodeError:
        return (), f"docker info printed no JSON: {proc.stdout.strip()[:200]!r}"
    if not isinstance(value, list):
        return (), "docker info lists no DiscoveredDevices (Docker before 28 or CDI off)"
    ids = [str(d.get("ID")) for d in value
           if isinstance(d, dict) and str(d.get("Source", "")).lower() == "cdi" and d.get("ID")]
    return tuple(ids), None


def docker_run_argv(image: str, argv: Sequence[str], uuids: Sequence[str],
                    env: Mapping[str, str], *, docker: str = "docker",
                    discovered: Sequence[str] = (), info_error: str | None = None,
                    name: str | None = None) -> DockerPlan:
    """The one ``docker run`` for ``argv`` in ``image`` with ``env`` passed by ``-e``."""
    cmd: list[str] = [docker, "run", "--rm", "--init"]
    if name:
        cmd += ["--name", name]
    wanted = [f"{CDI_KIND}={u}" for u in uuids]
    if not uuids:
        injection = "none"
    elif all(w in discovered for w in wanted):
        injection = "cdi"
        for w in wanted:
            cmd += ["--device", w]
    else:
        injection = "gpus-all"
        cmd += ["--gpus", "all"]
    for key in sorted(env):
        cmd += ["-e", f"{key}={env[key]}"]
    cmd.append(image)
    cmd += list(argv)
    return DockerPlan(tuple(cmd), injection, tuple(discovered), info_error)


def plan_docker(image: str, argv: Sequence[str], uuids: Sequence[str], env: Mapping[str, str],
                *, docker: str = "docker", name: str | None = None) -> DockerPlan:
    """Ask the daemon for its CDI devices once, then build the one ``docker run``."""
    discovered, error = discovered_devices(docker) if uuids else ((), None)
    return docker_run_argv(image, argv, uuids, env, docker=docker, discovered=discovered,
                           info_error=error, name=name)
