"""The Grafana dashboard: structure (unique ids, datasource variable everywhere, no
hard-coded datasource uid), and every PromQL expression evaluated, with the variables
substituted, against a real Prometheus that scraped real `gpudiag serve` daemons on the fake
driver: each must return data. The same Prometheus loads the alert rules."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpudiag.engine.announce import begin_run, end_body, end_run
from gpudiag.engine.locks import release, try_lock
from tests.fakes.build import FakeDriver
from tests.support.daemon import Daemon
from tests.support.prometheus import (
    PROMETHEUS,
    http_json,
    node_env,
    start_daemon,
    start_prometheus,
)

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "grafana" / "gpudiag.json"
PROVISIONING = ROOT / "grafana" / "provisioning"
DS_REF = {"type": "prometheus", "uid": "${datasource}"}


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def all_panels() -> list[dict[str, Any]]:
    out = []
    for p in dashboard()["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # panels inside collapsed rows
    return out


def data_panels() -> list[dict[str, Any]]:
    return [p for p in all_panels() if p["type"] != "row"]


def expressions() -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) for every query of every panel."""
    return [(p["title"], t["refId"], t["expr"]) for p in data_panels() for t in p["targets"]]


# --- structure ----------------------------------------------------------------------------

def test_panel_ids_are_unique() -> None:
    ids = [p["id"] for p in all_panels()]
    assert len(ids) == len(set(ids)), sorted(ids)


@pytest.mark.parametrize("title", [p["title"] for p in data_panels()])
def test_every_panel_and_query_uses_the_datasource_variable(title: str) -> None:
    (panel,) = [p for p in data_panels() if p["title"] == title]
    assert panel["datasource"] == DS_REF
    assert panel["targets"], f"{title}: no query"
    for t in panel["targets"]:
        assert t["datasource"] == DS_REF
        assert t["expr"].strip()


def test_no_hard_coded_datasource_uid() -> None:
    text = DASHBOARD.read_text()
    uids = set(re.findall(r'"uid":\s*"([^"]*)"', text))
    # The dashboard's own uid and Grafana's built-in annotation source are not datasources.
    assert uids <= {"${datasource}", dashboard()["uid"], "-- Grafana --"}, uids
    assert "__inputs" not in dashboard()  # an export-for-sharing file would need import mapping
    assert "${DS_" not in text


def test_variables_and_schema_for_grafana_10() -> None:
    d = dashboard()
    assert d["schemaVersion"] >= 38  # Grafana 10.0's
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("instance", "gpu"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"] == DS_REF
    exprs = " ".join(e for _, _, e in expressions())
    assert 'instance=~"$instance"' in exprs and 'gpu=~"$gpu"' in exprs


def test_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for p in all_panels():
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]


def test_provisioning_examples_parse() -> None:
    yaml = pytest.importorskip("yaml", reason="PyYAML is in the test extra")
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "gpudiag.yaml").read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]
    sources = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yaml").read_text())
    assert sources["datasources"][0]["type"] == "prometheus"


# --- a real Prometheus scraping real daemons ----------------------------------------------

@dataclass
class Fleet:
    prometheus_url: str
    healthy: Daemon
    blocked: Daemon
    healthy_locks: Path  # node a's GPU lock folder
    healthy_socket: Path  # node a's unix socket (where runs announce themselves)

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"{self.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        answer = http_json(url)
        assert answer["status"] == "success", answer
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result


@pytest.fixture(scope="module")
def fleet(fakes: FakeDriver, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    if PROMETHEUS is None:
        pytest.skip("prometheus not installed (apt-get install prometheus)")
    root = tmp_path_factory.mktemp("fleet")
    env_a = {**node_env(fakes, root / "host-a", FAKE_NVML_UTILIZATION="0:40,1:60"),
             "GPUDIAG_LOCK_DIR": str(root / "locks")}
    healthy = start_daemon(root / "a", env_a, ("--socket", str(root / "a.sock")))
    # Node b: GPU 1 fell off the bus (XID 79), has a failed row remap and uncorrectable
    # ECC errors, and another VBIOS than GPU 0; GPU 0 saw an application XID 13 (a warning,
    # not a blocker).
    blocked = start_daemon(root / "b", node_env(
        fakes, root / "host-b", FAKE_NVML_XIDS="1:79,0:13",
        FAKE_NVML_REMAPPED_ROWS="1:0/0/0/1", FAKE_NVML_ECC_AGGREGATE_UNCORRECTED="1:2",
        FAKE_NVML_VBIOS="1:96.00.9F.00.01"))
    prometheus = start_prometheus(root, [healthy.instance, blocked.instance])
    port = prometheus.port  # type: ignore[attr-defined]
    try:
        yield Fleet(f"http://127.0.0.1:{port}", healthy, blocked, root / "locks",
                    root / "a.sock")
    finally:
        prometheus.terminate()
        for daemon in (healthy, blocked):
            daemon.stop()
        try:
            prometheus.wait(10)
        except subprocess.TimeoutExpired:
            prometheus.kill()
            prometheus.wait()


def regex_escape(value: str) -> str:
    """How Grafana puts a multi-value variable's value into a PromQL =~ string."""
    return re.sub(r"([\\^$*+?.()|\[\]{}])", r"\\\\\1", value)


def substitute(expr: str, instance: str, gpu: str) -> str:
    for name, value in (("$__rate_interval", "10s"), ("$__interval", "1s"),
                        ("$__range", "10m"), ("$instance", instance), ("$gpu", gpu)):
        expr = expr.replace(name, value)
    assert "$" not in expr, expr
    return expr


def wait_for_every_expression(fleet: Fleet, cases: list[tuple[str, str, str]],
                              timeout_s: float = 60.0) -> dict[str, str]:
    """Poll until every expression has data (rate windows need a few scrapes)."""
    deadline = time.monotonic() + timeout_s
    empty: dict[str, str] = {}
    while time.monotonic() < deadline:
        empty = {}
        for label, expr, _ in cases:
            try:
                if not fleet.query(expr):
                    empty[label] = expr
            except OSError as e:  # Prometheus still starting
                empty[label] = f"{expr} ({e})"
        if not empty:
            break
        time.sleep(1.0)
    return empty


def test_every_dashboard_expression_returns_data(fleet: Fleet) -> None:
    blocked_only = "(" + regex_escape(fleet.blocked.instance) + ")"
    cases = []
    for instance, gpu, view in ((".*", ".*", "all nodes"), (blocked_only, "1", "node b gpu 1")):
        for title, ref, expr in expressions():
            cases.append((f"{view}: {title} [{ref}]", substitute(expr, instance, gpu), view))
    empty = wait_for_every_expression(fleet, cases)
    assert not empty, "expressions without data:\n" + "\n".join(
        f"  {k}: {v}" for k, v in empty.items())
    # The data is the daemons' own, not just any series.
    by_code = fleet.query(substitute(
        next(e for t, _, e in expressions() if t == "Nodes by blocker code"), ".*", ".*"))
    assert {r["metric"]["code"] for r in by_code} >= {"gpu_lost"}
    assert fleet.query("sum(gpudiag_ready)")[0]["value"][1] == "1"


def _range_max(fleet: Fleet, expr: str, since: float) -> dict[tuple[str, str], float]:
    """Each (gpu, xid) series' largest value of ``expr`` over [since, now], step 1 s, as
    Grafana draws a time-series panel."""
    url = f"{fleet.prometheus_url}/api/v1/query_range?" + urllib.parse.urlencode(
        {"query": expr, "start": since, "end": time.time(), "step": 1})
    answer = http_json(url)
    assert answer["status"] == "success", answer
    return {(r["metric"].get("gpu", ""), r["metric"].get("xid", "")):
            max(float(v) for _, v in r["values"]) for r in answer["data"]["result"]}


def test_the_xid_events_panel_shows_the_first_xid_of_a_gpu(fleet: Fleet) -> None:
    """Node b's XIDs were its counters' first: each series is born at 1, where increase()
    alone reads 0 for ever; the panel counts a series born within its interval whole."""
    since = time.time() - 300
    expr = substitute(next(e for t, _, e in expressions() if t == "XID events"),
                      "(" + regex_escape(fleet.blocked.instance) + ")", ".*")
    wait_for_every_expression(fleet, [("xid", "gpudiag_gpu_xid_errors_total", "")])
    deadline = time.monotonic() + 30
    seen: dict[tuple[str, str], float] = {}
    while time.monotonic() < deadline:
        seen = _range_max(fleet, expr, since)
        if seen.get(("1", "79"), 0) >= 1 and seen.get(("0", "13"), 0) >= 1:
            break
        time.sleep(1.0)
    assert seen.get(("1", "79"), 0) >= 1 and seen.get(("0", "13"), 0) >= 1, seen
    # What the panel's expression replaced: increase() over a series born at 1 shows none.
    bare = substitute('sum by (gpu, xid) (increase(gpudiag_gpu_xid_errors_total'
                      '{instance=~"$instance"}[$__rate_interval]))',
                      "(" + regex_escape(fleet.blocked.instance) + ")", ".*")
    assert _range_max(fleet, bare, since).get(("1", "79"), 0) < 1


def test_dashboard_variables_resolve(fleet: Fleet) -> None:
    wait_for_every_expression(fleet, [("ready", "gpudiag_gpu_info", "")])
    for var in dashboard()["templating"]["list"]:
        if var["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.*), (\w+)\)", var["query"]["query"])
        assert match, var["query"]
        selector = match.group(1).replace("$instance", ".*")
        url = (f"{fleet.prometheus_url}/api/v1/label/{match.group(2)}/values?"
               + urllib.parse.urlencode({"match[]": selector}))
        values = http_json(url)["data"]
        if var["name"] == "instance":
            assert set(values) == {fleet.healthy.instance, fleet.blocked.instance}
        if var["name"] == "gpu":
            assert set(values) == {"0", "1"}


def test_alert_rules_evaluate_on_the_real_metrics(fleet: Fleet) -> None:
    """The rules load without error in the real Prometheus and alert on node b's XID 79."""
    deadline = time.monotonic() + 60
    firing: dict[str, set[str]] = {}
    while time.monotonic() < deadline:
        try:
            groups = http_json(f"{fleet.prometheus_url}/api/v1/rules")["data"]["groups"]
        except OSError:  # Prometheus still starting
            time.sleep(0.5)
            continue
        rules = [r for g in groups for r in g["rules"]]
        assert rules and all(r["health"] in {"ok", "unknown"} for r in rules), [
            (r["name"], r.get("lastError")) for r in rules if r["health"] == "err"]
        firing = {}
        for alert in http_json(f"{fleet.prometheus_url}/api/v1/alerts")["data"]["alerts"]:
            firing.setdefault(alert["labels"]["alertname"], set()).add(
                f'{alert["labels"]["instance"]}/{alert["state"]}')
        if {"GpudiagCriticalXid", "GpudiagEccUncorrectable", "GpudiagNodeBlocked"} <= set(
                firing):
            break
        time.sleep(1.0)
    b, a = fleet.blocked.instance, fleet.healthy.instance
    assert firing.get("GpudiagCriticalXid") == {f"{b}/firing"}, firing
    assert firing.get("GpudiagEccUncorrectable") == {f"{b}/firing"}, firing
    # NodeBlocked waits 5 minutes before firing: pending here, and only for node b.
    assert {s.split("/")[0] for s in firing.get("GpudiagNodeBlocked", set())} == {b}, firing
    assert f"{a}/firing" not in {s for states in firing.values() for s in states}, firing
    for name in ("GpudiagNodeBlocked", "GpudiagBackendDown", "GpudiagCriticalXid"):
        assert not any(s.startswith(a) for s in firing.get(name, set())), firing


def test_fleet_panels_show_each_node_s_free_healthy_gpus_per_backend(fleet: Fleet) -> None:
    """Node a has both GPUs free and healthy for cuda; node b lost GPU 1 (XID 79)."""
    expr = substitute(next(e for t, _, e in expressions()
                           if t == "Free healthy GPUs per node and backend"), ".*", ".*")
    want = {(fleet.healthy.instance, "cuda"): 2.0, (fleet.blocked.instance, "cuda"): 1.0}
    deadline = time.monotonic() + 60
    got: dict[tuple[str, str], float] = {}
    while time.monotonic() < deadline:
        got = {(r["metric"]["instance"], r["metric"]["backend"]): float(r["value"][1])
               for r in fleet.query(expr)}
        if {k: got.get(k) for k in want} == want:
            break
        time.sleep(1.0)
    assert {k: got.get(k) for k in want} == want, got
    # jax and iree are not probed by these daemons: listed, never ready.
    assert {v for (_, b), v in got.items() if b != "cuda"} == {0.0}
    readiness = {r["metric"].get("backend", "unknown"): r["value"][1] for r in fleet.query(
        'count by (backend) (gpudiag_backend_ready == 1)')}
    assert readiness == {"cuda": "2"}



def test_the_power_panel_joins_the_job_holding_a_gpu_by_its_job_id_once_per_gpu(
        fleet: Fleet) -> None:
    """The allocation's label is ``job_id``: Prometheus keeps its own ``job`` (the scrape
    job) and would store a target's ``job`` as ``exported_job``, so the join showed
    ``job="gpudiag"``. Each GPU is one row, held or not. The holder is an attested run: this
    test's process locks GPU 0 and announces itself on node a's socket."""
    a = fleet.healthy.instance
    wait_for_every_expression(fleet, [("info", f'gpudiag_gpu_info{{instance="{a}"}}', "")])
    uuids = sorted(r["metric"]["uuid"] for r in fleet.query(
        f'gpudiag_gpu_info{{instance="{a}"}}'))
    lock = try_lock(fleet.healthy_locks, uuids[0])
    assert lock is not None
    url = f"unix:{fleet.healthy_socket}"
    run, why = begin_run(url, [uuids[0]], "4242", os.environ)
    assert run is not None, why
    expr = substitute(next(e for t, _, e in expressions()
                           if t == "GPU power and the job holding it"), ".*", ".*")
    try:
        deadline = time.monotonic() + 60
        rows: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            rows = [r["metric"] for r in fleet.query(expr) if r["metric"]["instance"] == a]
            if any(m.get("job_id") == "4242" for m in rows):
                break
            time.sleep(1.0)
        held = [m for m in rows if m.get("job_id") == "4242"]
        assert [m["uuid"] for m in held] == [uuids[0]], rows
        assert held[0]["job"] == "gpudiag" and held[0]["scheduler"] == "slurm"
        assert held[0]["user"] and "exported_job" not in held[0]
        assert sorted(m["uuid"] for m in rows) == uuids, rows  # one row per GPU
        joined = fleet.query(f'gpudiag_gpu_power_watts{{instance="{a}"}} * on (instance, '
                             "uuid) group_left (job_id, user) gpudiag_gpu_allocation_info")
        assert [r["metric"]["job_id"] for r in joined] == ["4242"]
    finally:
        end_run(url, run, 0, os.getpid(), end_body([], None, []), os.environ)
        release([lock])


def test_the_drift_panel_shows_the_field_a_node_s_gpus_differ_in(fleet: Fleet) -> None:
    (expr,) = [e for t, _, e in expressions() if t.startswith("GPU configuration that differs")]
    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + 30
    while not rows and time.monotonic() < deadline:
        rows = fleet.query(substitute(expr, ".*", ".*"))
        time.sleep(0.5)
    seen = {(r["metric"]["instance"], r["metric"]["gpu"], r["metric"]["field"],
             r["metric"]["value"]) for r in rows}
    b = fleet.blocked.instance
    assert seen == {(b, "0", "vbios_version", "96.00.9F.00.04"),
                    (b, "1", "vbios_version", "96.00.9F.00.01")}
