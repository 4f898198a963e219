"""benchmarks/knee_scale.py's pure parts: anchors per type, the curve's summary, the table, the doc section.

No simulator, no embedding model, no Ray: synthetic curves and rows only (well under a second).

    bash scripts/test.sh tests/unit/test_knee_scale.py -q
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def ks():
    sys.path.insert(0, str(BENCH_DIR))
    try:
        spec = importlib.util.spec_from_file_location("_knee_scale", BENCH_DIR / "knee_scale.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH_DIR))
    return module


def test_anchors_per_type_counts_every_type_in_order(ks):
    types = ["boil", "boil", "melt", "freeze", "melt", "boil"]
    got = ks.anchors_per_type(types, [0, 2, 5], ["melt", "boil", "freeze", "grow-plant"])
    assert got == {"melt": 1, "boil": 2, "freeze": 0, "grow-plant": 0}
    assert list(got) == ["melt", "boil", "freeze", "grow-plant"]
    spread = ks.type_spread(got)
    assert spread["types"] == 4 and spread["types_covered"] == 2
    assert (spread["anchors_min"], spread["anchors_median"], spread["anchors_max"]) == (0, 0.5, 2)
    assert spread["types_without_anchor"] == ["freeze", "grow-plant"]


def test_curve_summary_on_a_synthetic_curve(ks):
    from hamo_ray.selection import knee_point

    n = 100
    curve = [40, 60, 72, 80, 86, 90, 93, 95, 97, 98, 99, 100]  # diminishing returns, saturates at 12 picks
    budget = knee_point(curve)
    s = ks.curve_summary(curve, n, budget)
    assert s["saturation_picks"] == 12 and s["budget"] == budget
    assert s["budget_fraction"] == pytest.approx(budget / n)
    assert s["covered_at_knee"] == pytest.approx(curve[budget - 1] / n)
    assert s["floor_budget"] == 50 and s["knee_below_floor"] is True
    # a knee at the floor or above is not below it
    assert ks.curve_summary([1, 2, 3, 4], 4, 4)["knee_below_floor"] is False
    assert ks.curve_summary([], 0, 0)["covered_at_knee"] == 0.0


def _row(ks, stage, embed, budget, anchors):
    types = ["boil", "melt", "freeze"]
    per_type = dict(zip(types, anchors, strict=True))
    return {
        "stage": stage, "embed": embed, "tasks": 10, "trajectories": 9, "left_out": 1, "gold_s": 12.0,
        "distil_s": 0.01, "embed_s": 1.5, "store_s": 0.2, "select_s": 0.004, "jvm_start_s": 2.0,
        "embedder_load_s": 4.0, "trajectories_per_type": {t: 3 for t in types},
        **ks.curve_summary([4, 7, 8, 9], 9, budget), **ks.type_spread(per_type), "anchors_per_type": per_type,
        "curve": [4, 7, 8, 9],
    }  # fmt: skip


def test_table_and_section_come_from_the_rows(ks):
    rows = [_row(ks, 1, "card", 2, [1, 1, 0]), _row(ks, 1, "key", 1, [1, 0, 0])]
    lines = ks.table_lines(rows)
    assert len(lines) == 4 and set(lines[1]) == {"-"}
    assert "22.2%" in lines[2] and "2/3" in lines[2] and "1/3" in lines[3]
    data = {
        "rows": rows,
        "args": {"stages": 1, "per_task": 3, "workers": 2, "min_budget": 1, "json": "docs/results/x.json"},
        "machine": {"cpu_count": 2}, "started_at": "2026-01-01T00:00:00+00:00", "seconds": 90.0,
        "git": {"commit": "0123456789abcdef"},
    }  # fmt: skip
    text = ks.render_section(data, "results/knee-scale.png")
    assert "| 1 | card | 9 | 4 | 2 | 22.2% | 77.8% | 5 | 2 of 3 | 0 / 1 / 1 |" in text
    assert "| 1 | key | 9 | 4 | 1 | 11.1% | 44.4% | 5 | 1 of 3 | 0 / 0 / 1 |" in text
    assert "| `freeze` | 3 | 0 | 0 |" in text and "| `melt` | 3 | 1 | 0 |" in text
    assert "(card): `freeze`." in text and "(key): `freeze`, `melt`." in text
    assert "--report docs/results/x.json" in text and "1.5 min in all" in text
    assert text.endswith("![The coverage curves and their knees](results/knee-scale.png)")


def test_replace_section_keeps_the_rest_and_needs_markers(ks):
    doc = "# T\n\nintro\n<!-- BEGIN knee-scale -->\nold\n<!-- END knee-scale -->\nafter\n"
    new = ks.replace_section(doc, "knee-scale", "new body\n")
    assert new == "# T\n\nintro\n<!-- BEGIN knee-scale -->\nnew body\n<!-- END knee-scale -->\nafter\n"
    assert ks.replace_section(new, "knee-scale", "new body") == new  # idempotent
    with pytest.raises(ValueError, match="BEGIN knee-scale"):
        ks.replace_section("no markers", "knee-scale", "x")
