"""Prometheus rules: promtool check/test pass, every alert has a firing and a quiet case,
and the NodeBlocked remediation annotation covers the whole blocker catalog.

``scripts/gen_rule_remediation.py`` writes the remediation block from the catalog; a test
here checks it is current.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from gpudiag.core.catalog import BLOCKERS
from scripts import gen_rule_remediation
from tests.support.prometheus import PROMTOOL, ROOT, RULE_TESTS, RULES, promtool

yaml = pytest.importorskip("yaml", reason="PyYAML is in the test extra (pip install -e .[test])")

needs_promtool = pytest.mark.skipif(PROMTOOL is None,
                                    reason="promtool not installed (apt-get install prometheus)")


def load_rules() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(RULES.read_text())
    return data


def alerts() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in load_rules()["groups"] for r in g["rules"] if "alert" in r}


@needs_promtool
def test_promtool_check_rules_passes() -> None:
    proc = promtool("check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


@needs_promtool
def test_promtool_unit_tests_pass() -> None:
    proc = promtool("test", "rules", str(RULE_TESTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def _cases() -> list[tuple[str, bool]]:
    """(alert name, fires) for every expectation in the promtool test file."""
    doc = yaml.safe_load(RULE_TESTS.read_text())
    out = []
    for test in doc["tests"]:
        for case in test.get("alert_rule_test", []):
            out.append((case["alertname"], bool(case.get("exp_alerts"))))
    return out


@pytest.mark.parametrize("name", sorted(alerts()))
def test_every_alert_has_a_firing_and_a_quiet_case(name: str) -> None:
    cases = _cases()
    assert (name, True) in cases, f"{name}: no promtool case where it fires"
    assert (name, False) in cases, f"{name}: no promtool case where it stays quiet"


@pytest.mark.parametrize("name", sorted(alerts()))
def test_every_alert_has_severity_and_summary(name: str) -> None:
    rule = alerts()[name]
    assert rule["labels"]["severity"] in {"critical", "warning", "info"}
    assert rule["annotations"]["summary"].strip()
    if rule["labels"].get("scope") != "fleet":  # a fleet-wide number has no one node to name
        assert "{{ $labels.instance }}" in rule["annotations"]["summary"]


def test_remediation_block_matches_the_catalog() -> None:
    text = RULES.read_text()
    assert gen_rule_remediation.rewrite(text) == text, (
        "the remediation annotation is out of date with gpudiag/core/catalog.py: "
        "run .venv/bin/python scripts/gen_rule_remediation.py")


def test_the_generator_rewrites_a_stale_block_and_nothing_else() -> None:
    text = RULES.read_text()
    first = BLOCKERS[next(iter(BLOCKERS))].remediation
    stale = text.replace(first, "an old remediation", 1)
    assert stale != text
    assert gen_rule_remediation.rewrite(stale) == text


def test_the_generator_names_the_file_when_the_block_is_gone() -> None:
    with pytest.raises(ValueError, match=r"gpudiag\.rules\.yml: no '# BEGIN generated"):
        gen_rule_remediation.rewrite("groups: []\n")


@pytest.mark.parametrize("code", list(BLOCKERS))
def test_node_blocked_remediation_names_every_code(code: str) -> None:
    template = alerts()["GpudiagNodeBlocked"]["annotations"]["remediation"]
    branch = f'eq $labels.code "{code}" -}}}}\n{BLOCKERS[code].remediation}\n'
    assert branch in template


def test_metrics_used_are_in_the_contract() -> None:
    """Rules only use metric names docs/reference.md defines (or Prometheus's own ``up``)."""
    reference = ROOT / "docs" / "reference.md"
    names = set(re.findall(r"\bgpudiag_[a-z_]+[a-z]", RULES.read_text()))
    contract = set(re.findall(r"\bgpudiag_[a-z_]+[a-z]", reference.read_text()))
    missing = sorted(n for n in names if n not in contract)
    assert not missing, f"metrics not in docs/reference.md: {missing}"
    assert "gpudiag_blocker" in names

