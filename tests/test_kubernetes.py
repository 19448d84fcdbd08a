"""Kubernetes manifests: parsed, required fields present, probes on the daemon's real paths
and port; the node-problem-detector plugin keeps NPD's exit-code protocol."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpudiag.core.limits import DEFAULT_PORT
from gpudiag.daemon.config import load_config

yaml = pytest.importorskip("yaml", reason="PyYAML is in the test extra (pip install -e .[test])")

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes"
NPD_SCRIPT = K8S / "npd" / "gpudiag-npd.sh"
NPD_CONFIG = K8S / "npd" / "gpudiag-plugin.json"


def documents() -> list[dict[str, Any]]:
    """Every object of every manifest kustomization.yaml lists."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    out: list[dict[str, Any]] = []
    for name in kustomization["resources"]:
        out.extend(d for d in yaml.safe_load_all((K8S / name).read_text()) if d)
    return out


def the(kind: str) -> dict[str, Any]:
    found = [d for d in documents() if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def container() -> dict[str, Any]:
    spec = the("DaemonSet")["spec"]["template"]["spec"]
    (c,) = [c for c in spec["containers"] if c["name"] == "gpudiag"]
    found: dict[str, Any] = c
    return found


def test_every_object_has_api_version_kind_name_and_namespace() -> None:
    docs = documents()
    assert {d["kind"] for d in docs} >= {"Namespace", "ServiceAccount", "ConfigMap",
                                         "DaemonSet", "Service", "ServiceMonitor"}
    for d in docs:
        assert d["apiVersion"] and d["metadata"]["name"], d
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == "gpudiag", d["metadata"]


def test_daemonset_selector_matches_its_pods_and_the_service() -> None:
    ds = the("DaemonSet")
    selector = ds["spec"]["selector"]["matchLabels"]
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    assert the("Service")["spec"]["selector"].items() <= pod_labels.items()
    monitor = the("ServiceMonitor")["spec"]
    assert monitor["selector"]["matchLabels"].items() <= the("Service")["metadata"][
        "labels"].items()


def _port_number(name_or_number: str | int) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    (port,) = [p for p in container()["ports"] if p["name"] == name_or_number]
    return int(port["containerPort"])


@pytest.mark.parametrize(("probe", "path"), [("readinessProbe", "/readyz"),
                                             ("livenessProbe", "/healthz"),
                                             ("startupProbe", "/healthz")])
def test_probes_hit_the_daemon_paths_on_its_port(probe: str, path: str) -> None:
    get = container()[probe]["httpGet"]
    assert get["path"] == path
    assert _port_number(get["port"]) == DEFAULT_PORT


def test_daemon_listens_where_the_probes_and_prometheus_look(tmp_path: Path) -> None:
    config_file = tmp_path / "gpudiag.toml"
    config_file.write_text(the("ConfigMap")["data"]["gpudiag.toml"])
    cfg = load_config(config_file)
    assert cfg.listen_port == DEFAULT_PORT
    # Every address: the kubelet's probes and Prometheus come from outside the pod.
    assert cfg.listen_host == "0.0.0.0"
    args = container()["args"]
    assert args[:1] == ["serve"]
    assert args[args.index("--config") + 1] == "/etc/gpudiag/gpudiag.toml"
    mounts = {m["mountPath"]: m["name"] for m in container()["volumeMounts"]}
    assert mounts["/etc/gpudiag"] == "config"


def test_control_is_on_a_hostpath_socket_and_tcp_is_read_only(tmp_path: Path) -> None:
    """The cluster network reaches /metrics; verdicts and probes stay on the node."""
    from gpudiag.daemon.httpserver import READ_ONLY_PATHS
    from gpudiag.engine.client import DEFAULT_SOCKET, DEFAULT_URL

    config_file = tmp_path / "gpudiag.toml"
    config_file.write_text(the("ConfigMap")["data"]["gpudiag.toml"])
    cfg = load_config(config_file)
    assert cfg.tcp_read_only is True
    assert cfg.socket_path == DEFAULT_SOCKET
    # What the kubelet's probes and Prometheus ask for is still served on TCP.
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container()[probe]["httpGet"]["path"] in READ_ONLY_PATHS
    assert "/metrics" in READ_ONLY_PATHS and "/v1/preflight" not in READ_ONLY_PATHS
    pod = the("DaemonSet")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    folder = str(Path(DEFAULT_SOCKET).parent)
    assert volumes["socket"]["hostPath"] == {"path": folder, "type": "DirectoryOrCreate"}
    mounts = {m["mountPath"]: m["name"] for m in container()["volumeMounts"]}
    assert mounts[folder] == "socket"
    # The folder's owner is whom clients trust: made the daemon's by a chown-only init.
    (init,) = pod["initContainers"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    uid = pod["securityContext"]["runAsUser"]
    assert f"os.chown('{folder}', {uid}, {uid})" in " ".join(init["command"])
    assert "GPUDIAG_DAEMON_URL:-" + DEFAULT_URL in NPD_SCRIPT.read_text()


def test_scrape_configuration_points_at_metrics() -> None:
    ds_annotations = the("DaemonSet")["spec"]["template"]["metadata"]["annotations"]
    for notes in (ds_annotations, the("Service")["metadata"]["annotations"]):
        assert notes["prometheus.io/scrape"] == "true"
        assert notes["prometheus.io/port"] == str(DEFAULT_PORT)
        assert notes["prometheus.io/path"] == "/metrics"
    (endpoint,) = the("ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    (svc_port,) = [p for p in the("Service")["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert svc_port["port"] == DEFAULT_PORT
    # The alert rules select job="gpudiag": the ServiceMonitor's job is the Service's name.
    assert the("Service")["metadata"]["name"] == "gpudiag"


def test_pod_is_unprivileged_and_takes_no_gpu_from_workloads() -> None:
    c = container()
    pod = the("DaemonSet")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert "nvidia.com/gpu" not in json.dumps(c.get("resources", {}))
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in c["env"]
    assert c["resources"]["limits"]["memory"]


def test_npd_plugin_config_follows_the_custom_plugin_schema() -> None:
    cfg = json.loads(NPD_CONFIG.read_text())
    assert cfg["plugin"] == "custom"
    assert cfg["pluginConfig"]["invoke_interval"].endswith("s")
    condition_types = {c["type"] for c in cfg["conditions"]}
    for rule in cfg["rules"]:
        assert rule["type"] in {"temporary", "permanent"}
        assert Path(rule["path"]).name == NPD_SCRIPT.name
        assert _seconds(rule["timeout"]) < _seconds(cfg["pluginConfig"]["invoke_interval"])
        if rule["type"] == "permanent":
            assert rule["condition"] in condition_types
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    (generator,) = kustomization["configMapGenerator"]
    assert sorted(generator["files"]) == ["npd/gpudiag-npd.sh", "npd/gpudiag-plugin.json"]


def _seconds(text: str) -> float:
    assert text.endswith("s")
    return float(text[:-1])


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(("knobs", "extra", "rc", "message"), [
    ({}, {}, 0, "gpudiag: ready"),
    ({"FAKE_CUDA_INIT_ERROR": "999"}, {}, 1, "gpudiag: cuda_init_failed"),
    ({"FAKE_NVML_INIT_ERROR": "18"}, {}, 1, "gpudiag: driver_library_mismatch"),
    ({}, {"GPUDIAG_NPD_REQUIRE": "nonsense"}, 2, "gpudiag: health check failed (exit 2)"),
], ids=["ready", "cuda-blocked", "driver-mismatch", "gpudiag-usage-error"])
def test_npd_plugin_maps_preflight_exit_codes_to_npd(
        gpu_env: Callable[..., dict[str, str]], knobs: dict[str, str],
        extra: dict[str, str], rc: int, message: str) -> None:
    env = gpu_env(**knobs)
    env.update({"GPUDIAG": str(Path(sys.executable).with_name("gpudiag")),
                "GPUDIAG_DAEMON_URL": f"http://127.0.0.1:{_closed_port()}", **extra})
    proc = subprocess.run([str(NPD_SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == rc, proc.stdout + proc.stderr
    first_line = proc.stdout.splitlines()[0]
    assert first_line == message
    assert len(first_line) <= json.loads(NPD_CONFIG.read_text())["pluginConfig"][
        "max_output_length"]


# --- validated against the Kubernetes API schemas (kubernetes-validate ships them) ----------

# Custom resources have no schema in the Kubernetes API: the Prometheus Operator's CRD.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


def _kubernetes_validate() -> Any:
    return pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is in the test extra")


def test_the_validator_s_schemas_ship_in_the_package() -> None:
    """No network needed: the JSON schemas of the Kubernetes version validated against are
    files inside the installed package."""
    kv = _kubernetes_validate()
    schemas = Path(kv.__file__).parent / "kubernetes-json-schema"
    version = kv.latest_version()
    assert (schemas / f"v{version}-local-strict" / "daemonset-apps-v1.json").is_file()


def _api_documents() -> list[dict[str, Any]]:
    return [d for d in documents() if (d["apiVersion"], d["kind"]) not in CUSTOM_KINDS]


def test_only_the_known_custom_resources_go_unvalidated() -> None:
    custom = {(d["apiVersion"], d["kind"]) for d in documents()} - {
        (d["apiVersion"], d["kind"]) for d in _api_documents()}
    assert custom == CUSTOM_KINDS


@pytest.mark.parametrize("index", range(len(_api_documents())),
                         ids=[f"{d['kind']}/{d['metadata']['name']}" for d in _api_documents()])
def test_every_manifest_validates_strictly_against_the_api_schema(index: int) -> None:
    kv = _kubernetes_validate()
    doc = _api_documents()[index]
    version = kv.latest_version()
    try:
        kv.validate(doc, version, strict=True)
    except kv.ValidationError as e:
        pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} is not valid Kubernetes "
                    f"{version}: {e.message} at {'.'.join(str(p) for p in e.path)}")


def test_the_validator_refuses_what_yaml_parsing_alone_would_accept() -> None:
    """A mistyped field and a wrong type are caught, so the test above has teeth."""
    kv = _kubernetes_validate()
    ds = json.loads(json.dumps(the("DaemonSet")))
    ds["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kv.ValidationError):
        kv.validate(ds, kv.latest_version(), strict=True)
    ds = json.loads(json.dumps(the("DaemonSet")))
    ds["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "9477"
    with pytest.raises(kv.ValidationError):
        kv.validate(ds, kv.latest_version(), strict=True)


def test_the_daemon_writes_its_nfd_feature_file_into_the_node_s_features_d(
        tmp_path: Path) -> None:
    config_file = tmp_path / "gpudiag.toml"
    config_file.write_text(the("ConfigMap")["data"]["gpudiag.toml"])
    cfg = load_config(config_file)
    assert cfg.nfd_features_file is not None
    folder = str(Path(cfg.nfd_features_file).parent)
    pod = the("DaemonSet")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container()["volumeMounts"]}
    assert volumes[mounts[folder]]["hostPath"]["path"] == folder
    # The daemon (UID 65532) may write there: the init container hands it the group.
    (init,) = pod["initContainers"]
    assert folder in {m["mountPath"] for m in init["volumeMounts"]}
    assert f"d = '{folder}'; os.chown(d, -1, 65532)" in " ".join(init["command"])
