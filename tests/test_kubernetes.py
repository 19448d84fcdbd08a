"""Kubernetes manifests: parsed, required fields present, probes on the daemon's real paths
and port; node-problem-detector's pod patch merges into NPD's DaemonSet and its pieces agree
(the plugin and the relay themselves: tests/test_npd.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpudiag.core.limits import DEFAULT_PORT
from gpudiag.core.npd import MAX_MESSAGE_CHARS
from gpudiag.daemon.config import load_config
from tests.support.deploy import NPD_PATCH, npd_patch, npd_pod_container

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
    # node-problem-detector's relay asks that socket: the same node folder at the same path,
    # the clients' default URL (no --daemon-url), trusted as the folder's owner (uid).
    relay = npd_pod_container("gpudiag-npd-relay")
    assert "--daemon-url" not in relay["args"] and DEFAULT_URL == f"unix:{DEFAULT_SOCKET}"
    npd_volumes = {v["name"]: v for v in npd_patch()["spec"]["template"]["spec"]["volumes"]}
    (mount,) = [m for m in relay["volumeMounts"] if m["mountPath"] == folder]
    assert npd_volumes[mount["name"]]["hostPath"]["path"] == volumes["socket"]["hostPath"][
        "path"]
    assert relay["securityContext"]["runAsUser"] == uid


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
    assert cfg["pluginConfig"]["max_output_length"] == MAX_MESSAGE_CHARS
    condition_types = {c["type"] for c in cfg["conditions"]}
    for rule in cfg["rules"]:
        assert rule["type"] in {"temporary", "permanent"}
        assert Path(rule["path"]).name == NPD_SCRIPT.name
        assert _seconds(rule["timeout"]) < _seconds(cfg["pluginConfig"]["invoke_interval"])
        if rule["type"] == "permanent":
            assert rule["condition"] in condition_types
    # Nothing for NPD in gpudiag's own kustomization: the plugin comes from the image.
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert "configMapGenerator" not in kustomization


def _seconds(text: str) -> float:
    assert text.endswith("s")
    return float(text[:-1])


# --- node-problem-detector's pod: the patch that brings gpudiag's plugin and relay -------

# An NPD DaemonSet shaped as NPD's own deployment manifests are (its config ConfigMap at
# /config, read-only; a privileged container with no gpudiag), for the patch to merge into.
NPD_DAEMONSET: dict[str, Any] = {
    "apiVersion": "apps/v1", "kind": "DaemonSet",
    "metadata": {"name": "node-problem-detector", "namespace": "kube-system"},
    "spec": {
        "selector": {"matchLabels": {"app": "node-problem-detector"}},
        "template": {
            "metadata": {"labels": {"app": "node-problem-detector"}},
            "spec": {
                "containers": [{
                    "name": "node-problem-detector",
                    "image": "registry.example/node-problem-detector:v1",
                    "command": ["/node-problem-detector", "--logtostderr"],
                    "securityContext": {"privileged": True},
                    "volumeMounts": [{"name": "config", "mountPath": "/config",
                                      "readOnly": True}]}],
                "volumes": [{"name": "config",
                             "configMap": {"name": "node-problem-detector-config"}}]}}}}

# The keys a strategic-merge patch merges these lists of a pod by (the API's patchMergeKey).
_MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name",
               "volumeMounts": "mountPath", "env": "name"}


def _merge(base: Any, patch: Any, key: str = "") -> Any:
    """A strategic merge of ``patch`` into ``base`` for what the NPD patch uses: maps merge,
    the lists above merge by their key, other lists and values are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = _merge(base[k], v, k) if k in base else v
        return out
    if isinstance(base, list) and isinstance(patch, list) and key in _MERGE_KEYS:
        by = _MERGE_KEYS[key]
        out_list = list(base)
        for item in patch:
            at = [i for i, b in enumerate(out_list) if b.get(by) == item.get(by)]
            if at:
                out_list[at[0]] = _merge(out_list[at[0]], item)
            else:
                out_list.append(item)
        return out_list
    return patch


def npd_daemonset_with_gpudiag(tmp_path: Path) -> dict[str, Any]:
    """NPD's DaemonSet with the patch merged in (by kubectl's kustomize where installed, and
    always by ``_merge``: the two must agree)."""
    merged: dict[str, Any] = _merge(NPD_DAEMONSET, npd_patch())
    kubectl = shutil.which("kubectl")
    if kubectl is not None:
        (tmp_path / "npd.yaml").write_text(yaml.safe_dump(NPD_DAEMONSET))
        shutil.copy(NPD_PATCH, tmp_path / "patch.yaml")
        (tmp_path / "kustomization.yaml").write_text(
            "resources: [npd.yaml]\npatches:\n  - path: patch.yaml\n")
        proc = subprocess.run([kubectl, "kustomize", str(tmp_path)], capture_output=True,
                              text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr
        assert _sorted_lists(yaml.safe_load(proc.stdout)) == _sorted_lists(merged)
    return merged


def _sorted_lists(value: Any) -> Any:
    """Lists of mappings in a stable order (kustomize puts merged-in items first)."""
    if isinstance(value, dict):
        return {k: _sorted_lists(v) for k, v in value.items()}
    if isinstance(value, list) and all(isinstance(v, dict) for v in value):
        return sorted((_sorted_lists(v) for v in value),
                      key=lambda v: json.dumps(v, sort_keys=True))
    return value


def test_the_npd_patch_merges_into_npd_s_daemonset_and_validates(tmp_path: Path) -> None:
    kv = _kubernetes_validate()
    merged = npd_daemonset_with_gpudiag(tmp_path)
    try:
        kv.validate(merged, kv.latest_version(), strict=True)
    except kv.ValidationError as e:
        pytest.fail(f"NPD's DaemonSet with {NPD_PATCH.name} is not valid Kubernetes "
                    f"{kv.latest_version()}: {e.message} at {'.'.join(str(p) for p in e.path)}")
    spec = merged["spec"]["template"]["spec"]
    names = [c["name"] for c in spec["containers"]]
    assert names == ["node-problem-detector", "gpudiag-npd-relay"]
    # NPD's own container keeps what it had (its config, its command) and gains two mounts.
    npd_mounts = {m["mountPath"]: m for m in spec["containers"][0]["volumeMounts"]}
    assert npd_mounts["/config"]["name"] == "config"
    assert spec["containers"][0]["command"] == NPD_DAEMONSET["spec"]["template"]["spec"][
        "containers"][0]["command"]


def test_npd_runs_the_plugin_the_image_carries_and_reads_what_the_relay_writes() -> None:
    """The paths of the four pieces agree: the monitor config's rule, the init container's
    copy out of the image's share folder, NPD's mounts and the relay's status file."""
    from gpudiag.core.npd import DEFAULT_STATUS_FILE

    cfg = json.loads(NPD_CONFIG.read_text())
    (plugin_dir,) = {str(Path(rule["path"]).parent) for rule in cfg["rules"]}
    init = npd_pod_container("gpudiag-npd-plugin")
    share = "/opt/gpudiag/share/gpudiag/npd"
    assert init["command"] == ["cp", f"{share}/{NPD_SCRIPT.name}", f"{share}/{NPD_CONFIG.name}",
                               f"{plugin_dir}/"]
    containerfile = (ROOT / "Containerfile").read_text()
    assert (f"COPY npd/{NPD_SCRIPT.name} npd/{NPD_CONFIG.name} {share}/") in containerfile
    build = (ROOT / "scripts" / "build-image.sh").read_text()
    assert (f"cp deploy/kubernetes/npd/{NPD_SCRIPT.name} deploy/kubernetes/npd/"
            f"{NPD_CONFIG.name} \"$context/npd/\"") in build
    npd = npd_pod_container("node-problem-detector")
    relay = npd_pod_container("gpudiag-npd-relay")
    npd_mounts = {m["mountPath"]: m for m in npd["volumeMounts"]}
    relay_mounts = {m["mountPath"]: m for m in relay["volumeMounts"]}
    init_mounts = {m["mountPath"]: m for m in init["volumeMounts"]}
    assert npd_mounts[plugin_dir]["name"] == init_mounts[plugin_dir]["name"]
    assert npd_mounts[plugin_dir]["readOnly"] is True
    # The long-running relay cannot touch what NPD executes (as root): it lacks that volume.
    assert init_mounts[plugin_dir]["name"] not in {m["name"] for m in relay["volumeMounts"]}
    status_dir = str(Path(DEFAULT_STATUS_FILE).parent)
    assert npd_mounts[status_dir]["name"] == relay_mounts[status_dir]["name"]
    assert npd_mounts[status_dir]["readOnly"] is True and not relay_mounts[status_dir].get(
        "readOnly")
    args = relay["args"]
    assert args[0] == "npd-relay"
    assert args[args.index("--status-file") + 1] == DEFAULT_STATUS_FILE
    assert f"GPUDIAG_NPD_STATUS_FILE:-{DEFAULT_STATUS_FILE}}}" in NPD_SCRIPT.read_text()
    # Both emptyDirs: pod-private, in memory. The plugin and the relay use gpudiag's image,
    # the tag the gpudiag DaemonSet runs.
    volumes = {v["name"]: v for v in npd_patch()["spec"]["template"]["spec"]["volumes"]}
    for name in (npd_mounts[plugin_dir]["name"], npd_mounts[status_dir]["name"]):
        assert volumes[name]["emptyDir"]["medium"] == "Memory"
    assert {init["image"], relay["image"]} == {container()["image"]}
    for c in (init, relay):
        assert c["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert c["resources"]["limits"]["memory"]


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


def test_the_daemonset_keeps_its_history_and_held_xids_in_the_node_s_state_folder(
        tmp_path: Path) -> None:
    """A rollout must not forget held XIDs (issue 41): the state is the node's, not the pod's."""
    import os

    spec = the("DaemonSet")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["state"] == {"name": "state", "hostPath": {
        "path": "/var/lib/gpudiag", "type": "DirectoryOrCreate"}}
    assert {"name": "state", "mountPath": "/var/lib/gpudiag"} in container()["volumeMounts"]
    (init,) = spec["initContainers"]
    assert {"name": "state", "mountPath": "/var/lib/gpudiag"} in init["volumeMounts"]
    if os.geteuid() != 0:
        pytest.skip("the init script's chown needs root")
    # Its script, run twice on stand-ins for the node's folders: a fresh (root's) state
    # folder becomes the daemon's UID's, 0700; the second run (a restarted pod) still works.
    script = init["command"][-1]
    for path in ("/run/gpudiag/daemon", "/run/gpudiag/locks", "/var/lib/gpudiag",
                 "/etc/kubernetes/node-feature-discovery/features.d"):
        stand_in = tmp_path / path.strip("/").replace("/", "-")
        stand_in.mkdir(mode=0o755)
        script = script.replace(path, str(stand_in))
    for _ in range(2):
        subprocess.run([sys.executable, "-c", script], check=True)
        st = (tmp_path / "var-lib-gpudiag").stat()
        assert (st.st_uid, st.st_gid, oct(st.st_mode & 0o777)) == (65532, 65532, "0o700")


def _design_examples() -> list[dict[str, Any]]:
    """The remediation manifests docs/design-notes.md designs (```yaml blocks marked
    ``# k8s-example``)."""
    text = (ROOT / "docs" / "design-notes.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```yaml\n")[1:]]
    return [yaml.safe_load(b) for b in blocks if b.startswith("# k8s-example")]


def test_the_remediation_design_s_manifests_validate_against_the_api_schema() -> None:
    kv = _kubernetes_validate()
    docs = _design_examples()
    assert {d["kind"] for d in docs} == {"DeviceTaintRule", "Node"}
    for doc in docs:
        try:
            kv.validate(doc, kv.latest_version(), strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{doc['kind']} in docs/design-notes.md: {e.message} at "
                        f"{'.'.join(str(p) for p in e.path)}")
    rule = next(d for d in docs if d["kind"] == "DeviceTaintRule")
    assert rule["spec"]["taint"]["effect"] == "None"  # reports only, by default
