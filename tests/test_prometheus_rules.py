"""Prometheus rules: promtool check/test pass, every alert has a firing and a quiet case,
and the NodeBlocked remediation annotation covers the whole blocker catalog.

``python -m tests.test_prometheus_rules`` rewrites the generated remediation block after the
catalog changed.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import pytest

from gpudiag.core.catalog import BLOCKERS
from tests.support.prometheus import PROMTOOL, ROOT, RULE_TESTS, RULES, promtool

yaml = pytest.importorskip("yaml", reason="PyYAML is in the test extra (pip install -e .[test])")

BEGIN, END = "# BEGIN generated remediation", "# END generated remediation"
needs_promtool = pytest.mark.skipif(PROMTOOL is None,
                                    reason="promtool not installed (apt-get install prometheus)")


def remediation_template() -> str:
    """The Go template choosing the catalog's remediation by the alert's code label."""
    lines = []
    for i, entry in enumerate(BLOCKERS.values()):
        keyword = "if" if i == 0 else "else if"
        lines.append(f'{{{{- {keyword} eq $labels.code "{entry.code}" -}}}}')
        lines.append(entry.remediation)
    lines.append("{{- else -}}")
    lines.append("See the gpudiag blocker catalog for {{ $labels.code }}.")
    lines.append("{{- end -}}")
    return "\n".join(lines)


def generated_block(indent: str) -> str:
    body = "\n".join(indent + "  " + line for line in remediation_template().splitlines())
    return f"{indent}{BEGIN} (python -m tests.test_prometheus_rules rewrites it)\n" \
           f"{indent}remediation: |-\n{body}\n{indent}{END}"


def rewrite(text: str) -> str:
    """The rules file with its generated block replaced by the current catalog's."""
    pattern = re.compile(rf"^([ \t]*){re.escape(BEGIN)}.*?^[ \t]*{re.escape(END)}",
                         re.M | re.S)
    match = pattern.search(text)
    if match is None:
        raise ValueError(f"{RULES}: no '{BEGIN}' ... '{END}' block")
    return text[:match.start()] + generated_block(match.group(1)) + text[match.end():]


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
    assert "{{ $labels.instance }}" in rule["annotations"]["summary"]


def test_remediation_block_matches_the_catalog() -> None:
    text = RULES.read_text()
    assert rewrite(text) == text, (
        "the remediation annotation is out of date with gpudiag/core/catalog.py: "
        "run `python -m tests.test_prometheus_rules`")


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


if __name__ == "__main__":
    RULES.write_text(rewrite(RULES.read_text()))
    print(f"rewrote the remediation block of {RULES}", file=sys.stderr)
