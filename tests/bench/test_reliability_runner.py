"""The reliability suite's runner: parts by name, the wrong-bytes sum, the docs table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvbank.bench import SUITES, reliability
from kvbank.bench.reliability import BEGIN, END, PartUnavailable, goal_row

PART = '''
from kvbank.bench.reliability import goal_row

def run_part(quick):
    return [goal_row("case-a", "fraction", 1.0 if quick else 0.5, 1.0)], 7
'''


def test_suite_is_registered_and_the_procs_part_is_listed() -> None:
    assert SUITES["reliability"] == "kvbank.bench.reliability"
    assert reliability.PARTS["procs"] == "kvbank.bench.reliability_procs"
    assert reliability.PARTS["fleet"] == "kvbank.bench.reliability_fleet"


def test_a_part_that_cannot_be_imported_is_an_error_naming_that_part_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(reliability.PARTS, "gone", "kvbank.bench.no_such_part")
    with pytest.raises(PartUnavailable, match=r"part 'gone': kvbank\.bench\.no_such_part"):
        list(reliability.run(parts=["gone"]))
    with pytest.raises(PartUnavailable, match="no reliability part 'nope'"):
        reliability.load_part("nope")
    assert reliability.load_part("procs").run_part  # the others still load


def test_rows_of_every_part_then_wrong_bytes_summed(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "rel_part_one.py").write_text(PART)
    (tmp_path / "rel_part_two.py").write_text(PART)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(reliability.PARTS, "one", "rel_part_one")
    monkeypatch.setitem(reliability.PARTS, "two", "rel_part_two")
    rows = list(reliability.run(quick=False, parts=["one", "two"]))
    assert [r.case for r in rows] == ["case-a", "case-a", "wrong-bytes"]
    assert rows[0].ratio == 0.5 and rows[0].baseline == "goal"
    assert rows[-1].value == 14 and rows[-1].baseline_value == 0 and rows[-1].ratio == 14
    sys.modules.pop("rel_part_one", None)
    sys.modules.pop("rel_part_two", None)


def test_goal_row_ratio_is_the_value_for_a_zero_goal() -> None:
    assert goal_row("x", "s", 0.5, 1.0).ratio == 0.5
    assert goal_row("x", "rows", 0, 0).ratio == 0
    assert goal_row("x", "rows", 3, 0).ratio == 3


def test_doc_table_is_rewritten_between_the_markers(tmp_path: Path) -> None:
    doc = tmp_path / "r.md"
    doc.write_text(f"# t\n\n{BEGIN}\nold\n{END}\n\ntail\n")
    rows = [json.loads(goal_row("crash-puts", "fraction", 1.0, 1.0).to_json())]
    reliability.rewrite_doc(doc, reliability.markdown(rows), "note")
    text = doc.read_text()
    assert "old" not in text and text.endswith(f"{END}\n\ntail\n")
    assert "| `crash-puts` | fraction | 1 | 1 | 1 |" in text
    assert BEGIN in Path(__file__).parents[2].joinpath("docs/reliability.md").read_text()
