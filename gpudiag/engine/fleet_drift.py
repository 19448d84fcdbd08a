"""``gpudiag fleet --drift``: the nodes whose GPU inventory differs from their partition's.

Reads ``gpudiag_gpu_config_info{field,value}`` (core.gpu_config: driver, VBIOS, InfoROM,
GSP firmware, power limit, application clocks, persistence, ECC, compute and MIG mode) and
``gpudiag_gpu_info{name}`` of every node Prometheus scrapes now. Nodes are compared within
their group: the value of a target label (``partition`` by default: the label a site's scrape
config gives its nodes; nodes without it form one group) and their GPU model, so an H100 node
is never "drifted" against H200 ones. A node's value of a field is its GPUs' values, sorted
and joined (a node whose own GPUs disagree already warns ``gpu_config_drift`` itself, and
differs here too). A field's majority is the value most nodes of the group share; a tie
names no majority and says nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import Any

from gpudiag.core.gpu_config import FIELDS
from gpudiag.core.records import dataclass
from gpudiag.engine.fleet import FleetUsageError, PrometheusClient, Sample

DEFAULT_GROUP_LABEL = "partition"


@dataclass(frozen=True)
class DriftQuery:
    """The question: which scrape job, grouped by which target label."""

    job: str
    group_label: str = DEFAULT_GROUP_LABEL

    def __post_init__(self) -> None:
        label = self.group_label
        if not label or not (label[0].isascii() and (label[0].isalpha() or label[0] == "_")) \
                or not all(c.isascii() and (c.isalnum() or c == "_") for c in label):
            raise FleetUsageError(f"--drift-by {label!r}: give a Prometheus label name "
                                  "(letters, digits, '_')")
        if not self.job or '"' in self.job or "\\" in self.job:
            raise FleetUsageError(f"--job {self.job!r}: give the scrape job's plain name")


@dataclass(frozen=True)
class FieldDrift:
    """One field of one node against its group's majority."""

    field: str
    value: str
    majority: str
    agree: int   # nodes of the group with the majority's value
    of: int      # nodes of the group that report the field

    def record(self) -> dict[str, Any]:
        return {"field": self.field, "value": self.value, "majority": self.majority,
                "agree": self.agree, "of": self.of}


@dataclass(frozen=True)
class NodeDrift:
    """A node of a group and the fields where it differs (none: it agrees)."""

    instance: str
    group: str
    model: str
    fields: tuple[FieldDrift, ...] = ()

    def record(self) -> dict[str, Any]:
        return {"instance": self.instance, "group": self.group, "model": self.model,
                "drifted": bool(self.fields), "fields": [f.record() for f in self.fields]}


@dataclass(frozen=True)
class DriftAnswer:
    """Every node with an inventory, drifted ones first."""

    query: DriftQuery
    nodes: tuple[NodeDrift, ...] = field(default_factory=tuple)

    @property
    def any_drifted(self) -> bool:
        return any(n.fields for n in self.nodes)

    def record(self) -> dict[str, Any]:
        return {"query": {"job": self.query.job, "drift_by": self.query.group_label},
                "nodes": [n.record() for n in self.nodes]}


def drift_queries(q: DriftQuery) -> dict[str, str]:
    """The PromQL the answer is built from: only nodes whose scrape answers now."""
    job = f'job="{q.job}"'
    return {"config": f"gpudiag_gpu_config_info{{{job}}} == 1",
            "info": f"gpudiag_gpu_info{{{job}}} == 1",
            "live": f"up{{{job}}} == 1"}


def ask_drift(query: DriftQuery, client: PrometheusClient) -> DriftAnswer:
    """The nodes of ``query.job`` and where each differs from its group's majority."""
    exprs = drift_queries(query)
    live = {labels.get("instance", "") for labels, _ in client.query(exprs["live"])}
    config = [s for s in client.query(exprs["config"]) if s[0].get("instance") in live]
    info = [s for s in client.query(exprs["info"]) if s[0].get("instance") in live]
    return DriftAnswer(query, judge(config, info, query.group_label))


def _node_values(config: Sequence[Sample]) -> dict[str, dict[str, str]]:
    per: dict[str, dict[str, set[str]]] = {}
    for labels, _ in config:
        name, value = labels.get("field", ""), labels.get("value", "")
        if name in FIELDS and value:
            per.setdefault(labels.get("instance", ""), {}).setdefault(name, set()).add(value)
    return {i: {f: ",".join(sorted(v)) for f, v in fs.items()} for i, fs in per.items()}


def judge(config: Sequence[Sample], info: Sequence[Sample], group_label: str
          ) -> tuple[NodeDrift, ...]:
    """Each node's drift from the majority of its (group label, GPU model) group."""
    values = _node_values(config)
    models: dict[str, set[str]] = {}
    for labels, _ in info:
        if labels.get("name"):  # a lost GPU keeps its series, not always its name
            models.setdefault(labels.get("instance", ""), set()).add(labels["name"])
    groups: dict[str, str] = {}
    for labels, _ in config:
        groups.setdefault(labels.get("instance", ""), labels.get(group_label, ""))
    key: Mapping[str, tuple[str, str]] = {
        i: (groups.get(i, ""), ",".join(sorted(models.get(i, set()))) or "unknown")
        for i in values if i}
    out: list[NodeDrift] = []
    for g in sorted(set(key.values())):
        members = sorted(i for i, k in key.items() if k == g)
        found: dict[str, list[FieldDrift]] = {i: [] for i in members}
        for name in FIELDS:
            known = [(i, values[i][name]) for i in members if name in values[i]]
            counts: dict[str, int] = {}
            for _, v in known:
                counts[v] = counts.get(v, 0) + 1
            ranked = sorted(counts.items(), key=lambda kv: -kv[1])
            if len(ranked) < 2 or ranked[0][1] == ranked[1][1]:
                continue
            majority, agree = ranked[0]
            for i, v in known:
                if v != majority:
                    found[i].append(FieldDrift(name, v, majority, agree, len(known)))
        out += [NodeDrift(i, g[0], g[1], tuple(found[i])) for i in members]
    out.sort(key=lambda n: (not n.fields, n.group, n.model, n.instance))
    return tuple(out)


def render_drift(answer: DriftAnswer) -> str:
    """One line per drifted field of a node; then how many nodes agree."""
    q = answer.query
    head = f"fleet --drift: job {q.job}, nodes grouped by {q.group_label} and GPU model"
    if not answer.nodes:
        return f"{head}\nno nodes: Prometheus has no current gpudiag_gpu_config_info series"
    lines = [head]
    for n in answer.nodes:
        where = f"{q.group_label}={n.group or '-'}, {n.model}"
        lines += [f"{n.instance} ({where}): {f.field} {f.value}, the majority "
                  f"{f.majority} ({f.agree} of {f.of} nodes)" for f in n.fields]
    drifted = sum(1 for n in answer.nodes if n.fields)
    lines.append(f"{drifted} of {len(answer.nodes)} node(s) differ from their group's majority")
    return "\n".join(lines)
