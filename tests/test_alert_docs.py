"""docs/operations.md's alert table is generated from the rules file and current (issue 30)."""

from __future__ import annotations

import pytest

from scripts import gen_alert_docs


def test_the_alert_table_in_operations_is_current() -> None:
    text = gen_alert_docs.DOC.read_text()
    assert gen_alert_docs.rewrite(text) == text, "run python scripts/gen_alert_docs.py"


def test_every_alert_of_the_rules_file_is_in_the_table_once() -> None:
    text = gen_alert_docs.DOC.read_text()
    text = text.split(gen_alert_docs.BEGIN, 1)[1].split(gen_alert_docs.END, 1)[0]
    names = [r["alert"] for r in gen_alert_docs.rules() if "alert" in r]
    assert len(names) >= 11
    for name in names:
        assert text.count(f"| `{name}` |") == 1, name


def test_an_alert_without_a_description_fails_the_generator(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(gen_alert_docs.FIRES_WHEN, "GpudiagGpuUnhealthy")
    with pytest.raises(ValueError, match="add \\['GpudiagGpuUnhealthy'\\]"):
        gen_alert_docs.render()
