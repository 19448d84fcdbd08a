"""The container image, built by scripts/build-image.sh and run with podman the way the
NVIDIA container toolkit runs it: the (fake) driver bind-mounted, no network, non-root."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.build import FakeDriver
from tests.support.daemon import host_env, wait_for
from tests.support.deploy import build_image, require_root_tools
from tests.support.host import run_gpudiag

# podman's default runtime (crun) fails on this kind of machine (cgroups in hybrid mode, no
# CAP_SYS_RESOURCE for its rlimits): runc with lowered ulimits works (FIELD-NOTES).
PODMAN_RUN = ("podman", "run", "--runtime", "runc", "--ulimit", "nofile=1024:1024",
              "--ulimit", "nproc=1024:1024", "--network", "none")
LIBDIR = "/usr/lib/x86_64-linux-gnu"
# The image is built once per session: ~40 s with the cached Debian rootfs, ~3 min cold.
# A cold first build (mmdebstrap, no .cache/ on a fresh CI machine: ~3 min alone) counts
# against the first test's timeout, and waits for another worker's build of the checkout
# (tests/support/deploy.one_builder): the suite's 300 s per test is too short for that.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="session")
def image() -> str:
    """The image, built once per test session (the Debian rootfs is cached in .cache/)."""
    require_root_tools("buildah", "podman", "runc", "mmdebstrap")
    tag, seconds = build_image()
    print(f"scripts/build-image.sh: {seconds:.1f} s")
    return tag


def driver_mounts(fakes: FakeDriver, env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """podman arguments that mount the driver as the toolkit does (libraries into the
    loader's folder, nvidia-smi into /usr/bin) and pass the fake's knobs; the env inside."""
    args: list[str] = []
    for lib in sorted(fakes.lib_dir.iterdir()):
        args += ["-v", f"{lib.resolve()}:{LIBDIR}/{lib.name}:ro"]
    args += ["-v", f"{fakes.nvidia_smi}:/usr/bin/nvidia-smi:ro"]
    inside = {k: v for k, v in env.items() if k.startswith("FAKE_")}
    # The driver makes its device nodes 0666 (NVreg_DeviceFileMode), and the toolkit passes
    # them as they are: the image's user 65532 must be able to open them, as on a real node.
    for node in Path(env["GPUDIAG_DEVICE_DIR"]).iterdir():
        node.chmod(0o666)
    for key, where in (("GPUDIAG_DEVICE_DIR", "/host/dev"),
                       ("GPUDIAG_DRIVER_PROC_DIR", "/host/proc-driver-nvidia")):
        args += ["-v", f"{env[key]}:{where}:ro"]
        inside[key] = where
    inside["GPUDIAG_SYSFS_PCI_DIR"] = env.get("GPUDIAG_SYSFS_PCI_DIR", "")
    for key, value in inside.items():
        args += ["-e", f"{key}={value}"]
    return args, inside


def essence(record: dict[str, Any]) -> dict[str, Any]:
    """What must match between two verdicts of one host (not times, host names, paths)."""
    return {"gpu_validation_blocker": record["gpu_validation_blocker"],
            "ready": record["ready"],
            "blockers": sorted((b["code"], b.get("backend"), b.get("device"))
                               for b in record["blockers"]),
            "warnings": sorted((w["code"], w.get("backend")) for w in record["warnings"]),
            "devices": sorted(d.get("uuid") or "" for d in record.get("devices") or [])}


@pytest.mark.parametrize("knobs", [{}, {"FAKE_CUDA_INIT_ERROR": 100}],
                         ids=["healthy", "cuinit-no-device"])
def test_probe_in_the_container_gives_the_hosts_verdict(
        image: str, fakes: FakeDriver, tmp_path: Path, knobs: dict[str, Any]) -> None:
    env = host_env(fakes, tmp_path / "host", gpus=8, **knobs)
    # The slim image has the NVIDIA stack's probes (jax and iree come with the full flavour).
    probe = ["probe", "--backend", "host,nvml,cuda", "--format", "json"]
    host = run_gpudiag(probe, env)
    args, _ = driver_mounts(fakes, env)
    proc = subprocess.run([*PODMAN_RUN, "--rm", *args, image, *probe],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == host.returncode, proc.stderr[-3000:]
    inside = json.loads(proc.stdout)
    assert essence(inside) == essence(json.loads(host.stdout))
    if knobs:
        assert inside["gpu_validation_blocker"] != "none"


def test_the_image_runs_as_65532_with_the_entrypoint_gpudiag(image: str) -> None:
    proc = subprocess.run(["podman", "image", "inspect", image], capture_output=True,
                          text=True, timeout=60, check=True)
    (info,) = json.loads(proc.stdout)
    assert info["Config"]["User"] == "65532:65532"
    assert info["Config"]["Entrypoint"] == ["gpudiag"]
    assert 0 < info["Size"] < 400_000_000, info["Size"]  # the slim flavour: no jax, no iree


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short host folder owned by the image's user, for the daemon's socket."""
    folder = Path(tempfile.mkdtemp(prefix="gdc"))
    os.chown(folder, 65532, 65532)
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def http_over_unix(path: Path, target: str) -> tuple[int, str]:
    """A GET over the unix socket: (status, body)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        s.sendall(f"GET {target} HTTP/1.0\r\nHost: localhost\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


def test_serve_in_the_container_answers_through_a_bind_mounted_socket_folder(
        image: str, fakes: FakeDriver, tmp_path: Path, socket_dir: Path) -> None:
    env = host_env(fakes, tmp_path / "host", gpus=8)
    args, _ = driver_mounts(fakes, env)
    name = f"gpudiag-test-{os.getpid()}"
    cfg = tmp_path / "gpudiag.toml"
    cfg.write_text('listen = "127.0.0.1:9477"\nsocket = "/run/gpudiag/daemon/gpudiag.sock"\n'
                   "[backends.jax]\nenabled = false\n[backends.iree]\nenabled = false\n"
                   "[xid]\nenabled = false\n")
    cfg.chmod(0o644)
    subprocess.run([*PODMAN_RUN, "-d", "--name", name, "--read-only", "--tmpfs", "/tmp",
                    "-v", f"{socket_dir}:/run/gpudiag/daemon", "-v", f"{cfg}:/etc/gpudiag/"
                    "gpudiag.toml:ro", "--tmpfs", "/var/lib/gpudiag:rw,U",
                    *args, image, "serve", "--config", "/etc/gpudiag/gpudiag.toml"],
                   capture_output=True, text=True, timeout=60, check=True)
    sock = socket_dir / "gpudiag.sock"
    try:
        wait_for(sock.exists, 30)
        status, body = wait_for(lambda: (r := http_over_unix(sock, "/readyz"))[0] == 200
                                and r, 30)
        status, metrics = http_over_unix(sock, "/metrics")
        assert status == 200
        assert "gpudiag_ready 1.0" in metrics, metrics[:2000]
        assert 'gpudiag_gpu_info{' in metrics
        # A host client asks the container's daemon through the socket; it trusts the peer
        # as the daemon's user (the folder is under /tmp here, so it is named explicitly).
        proc = run_gpudiag(["preflight", "--require", "nvml", "--format", "json"],
                           {**env, "GPUDIAG_DAEMON_URL": f"unix:{sock}",
                            "GPUDIAG_DAEMON_USER": "65532"})
        verdict = json.loads(proc.stdout)
        assert proc.returncode == 0, proc.stderr
        assert verdict["source"] == "daemon", verdict.get("source")
        started = time.monotonic()
        subprocess.run(["podman", "stop", "-t", "10", name], capture_output=True, timeout=60,
                       check=True)
        assert time.monotonic() - started < 10  # SIGTERM ends it, not the kill after 10 s
        logs = subprocess.run(["podman", "logs", name], capture_output=True, text=True,
                              timeout=60, check=True).stderr
        assert "Traceback" not in logs, logs
        assert "stopping" in logs
    finally:
        subprocess.run(["podman", "rm", "-f", name], capture_output=True, timeout=60,
                       check=False)


def test_the_daemonset_runs_the_tag_the_script_builds() -> None:
    """The DaemonSet names what `scripts/build-image.sh --flavour full` tags by default (its
    config enables jax and iree); operators retag it for their registry with kustomize."""
    import yaml

    from gpudiag.core.version import __version__

    root = Path(__file__).resolve().parent.parent
    script = (root / "scripts" / "build-image.sh").read_text()
    assert 'tag=${tag:-localhost/gpudiag:$version${extras:+-full}}' in script
    (ds,) = [d for d in yaml.safe_load_all(
        (root / "deploy" / "kubernetes" / "daemonset.yaml").read_text()) if d]
    spec = ds["spec"]["template"]["spec"]
    images = {c["image"] for c in spec["containers"] + spec["initContainers"]}
    assert images == {f"localhost/gpudiag:{__version__}-full"}


def test_npd_s_pod_gets_the_plugin_from_the_image_and_the_answer_from_the_relay(
        image: str, fakes: FakeDriver, tmp_path: Path) -> None:
    """NPD's pod as deploy/kubernetes/npd/daemonset-patch.yaml makes it: the init container's
    command copies the plugin out of the image; the relay's container asks the daemon through
    the read-only socket folder and writes the shared status folder; the plugin, run as NPD's
    container would (bash, here with no PATH at all), passes the daemon's answer on."""
    from tests.support.daemon import Daemon, daemon_toml, write_config
    from tests.support.deploy import npd_pod_container

    top = Path(tempfile.mkdtemp(prefix="gdn"))  # short: a socket path is at most 107 bytes
    try:
        top.chmod(0o755)
        daemon_dir, plugin_dir, status_dir = top / "daemon", top / "plugin", top / "npd"
        daemon_dir.mkdir(mode=0o755)
        for emptydir in (plugin_dir, status_dir):  # the kubelet makes an emptyDir 0777
            emptydir.mkdir()
            emptydir.chmod(0o777)
        init = npd_pod_container("gpudiag-npd-plugin")
        (target,) = [m["mountPath"] for m in init["volumeMounts"]]
        subprocess.run([*PODMAN_RUN, "--rm", "--read-only", "-v", f"{plugin_dir}:{target}",
                        "--entrypoint", init["command"][0], image, *init["command"][1:]],
                       capture_output=True, text=True, timeout=120, check=True)
        npd_dir = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes" / "npd"
        for name in ("gpudiag-npd.sh", "gpudiag-plugin.json"):
            assert (plugin_dir / name).read_bytes() == (npd_dir / name).read_bytes(), name
        assert os.access(plugin_dir / "gpudiag-npd.sh", os.X_OK)
        env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_CUDA_INIT_ERROR=999)
        daemon = Daemon(env, write_config(tmp_path / "gpudiag.toml", daemon_toml()),
                        tmp_path / "state", extra_args=("--socket",
                                                        str(daemon_dir / "gpudiag.sock")))
        relay = npd_pod_container("gpudiag-npd-relay")
        mounts = {m["name"]: m["mountPath"] for m in relay["volumeMounts"]}
        try:
            daemon.wait_ready()
            proc = subprocess.run(
                [*PODMAN_RUN, "--rm", "--read-only",
                 "-v", f"{daemon_dir}:{mounts['gpudiag-socket']}:ro",
                 "-v", f"{status_dir}:{mounts['gpudiag-npd-status']}",
                 image, *relay["args"], "--once"],
                capture_output=True, text=True, timeout=120, check=False)
        finally:
            daemon.stop()
        # A fault is the node's incident: NPD's message is its id and its reason (issue 52).
        said = r"gpudiag-\d{8}T\d{6}Z-node: cuda_init_failed\n"
        assert proc.returncode == 1 and re.fullmatch(said, proc.stdout), proc.stderr[-3000:]
        ran = subprocess.run(["/bin/bash", str(plugin_dir / "gpudiag-npd.sh")],
                             env={"PATH": "/nonexistent",
                                  "GPUDIAG_NPD_STATUS_FILE": str(status_dir / "status")},
                             capture_output=True, text=True, timeout=30, check=False)
        assert (ran.returncode, ran.stdout, ran.stderr) == (1, proc.stdout, "")
    finally:
        shutil.rmtree(top, ignore_errors=True)
