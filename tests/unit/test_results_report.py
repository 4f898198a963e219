"""The learning experiments' report: tables over seeds and paired differences from exported cells."""

from __future__ import annotations

import json

import pytest
import yaml

from hamo_ray.evaluation.metrics import summarize
from hamo_ray.evaluation.report import (
    load_all,
    load_cells,
    main,
    method_table,
    paired_table,
    reading,
    section,
    stage_average,
    update_doc,
)


def _cell(root, method, seed, curve, initial=10.0):
    cell = root / "cells" / f"{method}-s{seed}"
    (cell / "results").mkdir(parents=True)
    (cell / "config.yaml").write_text(yaml.safe_dump({"method": {"name": method}, "run": {"seed": seed}}))
    metrics = summarize([{"scienceworld": v} for v in curve], initial={"scienceworld": initial})
    (cell / "results" / "metrics.json").write_text(json.dumps(metrics))
    (cell / "state.json").write_text(json.dumps({"stages": [{"seconds": {"evaluate": 1800.0}}]}))


def test_tables_and_paired_differences(tmp_path):
    _cell(tmp_path, "base", 0, [10, 12])
    _cell(tmp_path, "base", 1, [20, 20])
    _cell(tmp_path, "hamo", 0, [30, 40])
    _cell(tmp_path, "hamo", 1, [30, 30])
    _cell(tmp_path, "harness", 0, [11, 11])
    (tmp_path / "cells" / ".hamo-s2.tmp").mkdir()  # a half-written export is not a cell
    cells = load_cells(tmp_path)
    assert [(c["method"], c["seed"]) for c in cells] == [
        ("base", 0),
        ("base", 1),
        ("hamo", 0),
        ("hamo", 1),
        ("harness", 0),
    ]
    assert stage_average(cells[2]["metrics"]) == 35.0
    table = paired_table(cells)
    # hamo - base: seed 0: 35 - 11 = +24, seed 1: 30 - 20 = +10; mean 17 with a t interval over 2 seeds.
    row = next(line for line in table.splitlines() if "`hamo - base`" in line)
    assert "+24.0" in row and "+10.0" in row and "17.0 ±" in row
    assert row.endswith("| undecided |")  # t(1) = 12.7: two seeds of +24 and +10 include 0
    # hamo - harness has one seed only: no interval.
    row = next(line for line in table.splitlines() if "`hamo - harness`" in line)
    assert row.endswith("| +24.0 | - | 24.0 | one seed |")
    assert "`hamo - model_only`" not in table  # no model_only cell: no row
    assert "hamo_no_conditioning" not in table


def test_ablation_cells_get_their_paired_rows(tmp_path):
    _cell(tmp_path, "hamo", 0, [30, 40])
    _cell(tmp_path, "hamo_no_conditioning", 0, [20, 30])
    _cell(tmp_path, "hamo_release", 0, [32, 40])
    _cell(tmp_path, "base", 0, [10, 10])
    _cell(tmp_path, "model_only", 0, [28, 36])
    cells = load_cells(tmp_path)
    table = paired_table(cells)
    assert "| `hamo - hamo_no_conditioning` | +10.0 | 10.0 | one seed |" in table
    # The same anchors trained without cards, then shown cards at inference, against no cards at all.
    assert "| `hamo_no_conditioning - model_only` | -7.0 | -7.0 | one seed |" in table
    assert "| `hamo_release - hamo` | +1.0 | 1.0 | one seed |" in table
    methods = [line.split("`")[1] for line in method_table(cells).splitlines() if line.startswith("| `")]
    assert methods == ["base", "model_only", "hamo", "hamo_no_conditioning", "hamo_release"]


def test_the_document_section_is_replaced_between_markers(tmp_path):
    _cell(tmp_path, "base", 0, [10, 12])
    doc = tmp_path / "docs" / "results.md"
    doc.parent.mkdir()
    doc.write_text("# Results\nintro\n<!-- BEGIN exp -->\nold\n<!-- END exp -->\ntail\n")
    assert main([str(tmp_path), "--name", "exp", "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Results\nintro\n<!-- BEGIN exp -->\nFinished cells: 1") and text.endswith(
        "<!-- END exp -->\ntail\n"
    )
    assert "old" not in text and "| `base` | 0 | 11.0 |" in text
    assert (doc.parent / "results" / "exp.png").is_file() and "](results/exp.png)" in text
    with pytest.raises(ValueError, match="BEGIN other"):
        update_doc(doc, "other", "x")
    with pytest.raises(FileNotFoundError, match="cells"):
        load_cells(tmp_path / "nowhere")


def test_seen_columns_are_reported_but_not_counted_in_totals():
    """``<domain>@seen`` (``protocol.eval_seen``) is a column of its own: out of the final total and of
    the stage average over domains."""
    rows = [
        {"alfworld": 10.0, "webshop": 30.0, "alfworld@seen": 90.0},
        {"alfworld": 20.0, "webshop": 40.0, "alfworld@seen": 70.0},
    ]
    metrics = summarize(rows, stage_domains=["alfworld", "webshop"])
    assert metrics["final_total"] == 60.0
    assert metrics["stage_scores"]["alfworld@seen"] == [90.0, 70.0]
    assert stage_average(metrics) == (20.0 + 30.0) / 2


def _cross_cell(root, method, seed, science_curve):
    """A 3-stage S->A->W cell whose ScienceWorld curve is ``science_curve`` (the first domain)."""
    cell = root / "cells" / f"{method}-s{seed}"
    (cell / "results").mkdir(parents=True)
    (cell / "config.yaml").write_text(yaml.safe_dump({"method": {"name": method}, "run": {"seed": seed}}))
    rows = [{"scienceworld": v, "alfworld": 0.0, "webshop": 10.0} for v in science_curve]
    metrics = summarize(rows, stage_domains=["scienceworld", "alfworld", "webshop"])
    (cell / "results" / "metrics.json").write_text(json.dumps(metrics))


def test_cross_domain_sections_pair_the_first_domains_retention(tmp_path):
    """The paper's cross-domain claim is retention (HaMo keeps ScienceWorld, AgentTuning loses it): the
    section pairs it per seed like the stage average; a within-domain section has no such table."""
    _cross_cell(tmp_path, "hamo", 0, [30, 40, 35])
    _cross_cell(tmp_path, "hamo", 1, [30, 30, 45])
    _cross_cell(tmp_path, "agenttuning", 0, [35, 30, 5])
    _cross_cell(tmp_path, "agenttuning", 1, [30, 30, 15])
    cells = load_cells(tmp_path)
    table = paired_table(cells, metric="first-domain retention")
    assert table.startswith("| difference (first-domain retention) |")
    # seed 0: 35 - 5 = +30; seed 1: 45 - 15 = +30: the same difference twice, an interval of 0.
    assert "| `hamo - agenttuning` | +30.0 | +30.0 | 30.0 ± 0.0 | decided: `hamo` above |" in table
    text = section(cells, "cross", plot=None)
    for title in ("stage average", "first-domain retention", "last-domain score"):
        assert f"| difference ({title}) |" in text
    # the last domain (webshop) scores 10 after its stage in every cell: a difference of 0
    assert "| `hamo - agenttuning` | +0.0 | +0.0 | 0.0 ± 0.0 | undecided |" in paired_table(
        cells, metric="last-domain score"
    )
    within = tmp_path / "within"
    _cell(within, "hamo", 0, [30, 40])
    within_text = section(load_cells(within), "within", plot=None)
    assert "first-domain retention)" not in within_text and "last-domain score)" not in within_text
    with pytest.raises(ValueError, match="unknown metric 'accuracy'"):
        paired_table(cells, metric="accuracy")


def test_a_sweeps_first_cells_have_no_paired_table_yet(tmp_path):
    """One method's cells pair with nothing: a line that says so, not an empty table."""
    _cell(tmp_path, "model_only", 0, [18.0, 38.0])
    _cell(tmp_path, "hamo", 1, [20.0, 30.0])  # another seed: still no pair
    table = paired_table(load_cells(tmp_path))
    assert table == "No paired difference (stage average) yet: no seed has both cells of any pair."
    _cell(tmp_path, "hamo", 0, [20.0, 40.0])
    assert "| `hamo - model_only` | +2.0 | - | 2.0 | one seed |" in paired_table(load_cells(tmp_path))


def test_the_decision_rule_reads_each_paired_interval():
    """Decided when the 95% interval over seeds excludes 0 (either side), undecided otherwise."""
    from hamo_ray.evaluation.metrics import mean_interval

    assert reading(mean_interval([5.0, 6.0, 7.0]), "hamo", "model_only") == "decided: `hamo` above"
    assert reading(mean_interval([-5.0, -6.0, -7.0]), "hamo", "model_only") == "decided: `model_only` above"
    assert reading(mean_interval([5.0, -1.0, 7.0]), "hamo", "model_only") == "undecided"
    assert reading(mean_interval([5.0]), "hamo", "model_only") == "one seed"


def test_a_fixed_design_reads_the_rule_only_at_its_planned_seeds(tmp_path, capsys):
    """The powered rerun fixed 6 seeds: two seeds whose interval already excludes 0 give an interim
    reading that decides nothing; at 6 seeds the rule decides. Through the command line too."""
    from hamo_ray.evaluation.metrics import mean_interval

    two = mean_interval([-15.1, -14.4])
    assert two["ci_high"] < 0  # the interval of these two seeds excludes 0 ...
    assert reading(two, "hamo_no_conditioning", "model_only", planned=6) == (
        "interim (2 of 6 seeds): excludes 0, `model_only` above"
    )  # ... but the design reads the rule at 6
    assert reading(mean_interval([5.0, -1.0]), "hamo", "model_only", planned=6) == (
        "interim (2 of 6 seeds): includes 0"
    )
    six = mean_interval([-15.1, -14.4, -12.0, -16.0, -13.5, -14.0])
    assert reading(six, "hamo_no_conditioning", "model_only", planned=6) == "decided: `model_only` above"
    assert reading(mean_interval([5.0]), "hamo", "model_only", planned=6) == "one seed"

    for seed, (h, m) in enumerate([(40.0, 30.0), (42.0, 31.0)]):
        _cell(tmp_path, "hamo", seed, [h, h])
        _cell(tmp_path, "model_only", seed, [m, m])
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- BEGIN x -->\n<!-- END x -->\n")
    assert main([str(tmp_path), "--name", "x", "--doc", str(doc), "--planned-seeds", "6"]) == 0
    assert (
        "| `hamo - model_only` | +10.0 | +11.0 | 10.5 ± 6.4 | interim (2 of 6 seeds): excludes 0, `hamo` above |"
        in doc.read_text()
    )
    assert main([str(tmp_path), "--name", "x", "--doc", str(doc)]) == 0
    assert "| 10.5 ± 6.4 | decided: `hamo` above |" in doc.read_text()
    assert main([str(tmp_path), "--name", "x", "--planned-seeds", "1"]) == 2
    assert "--planned-seeds 1" in capsys.readouterr().out


def test_methods_planned_on_fewer_seeds_are_read_at_their_own_plan(tmp_path, capsys):
    """The powered rerun plans 6 seeds for the trained methods and 3 for base and harness: a pair is read
    at the smaller plan of its methods, so ``hamo - base`` decides at 3 seeds while ``hamo - model_only``
    stays interim. Bad entries are refused, named."""
    from hamo_ray.evaluation.report import Plan

    plan = Plan.parse(["6", "base=3", "harness=3"])
    assert plan.pair("hamo", "model_only") == 6
    assert plan.pair("hamo", "base") == 3 and plan.pair("harness", "base") == 3
    assert Plan.parse(["base=3"]).pair("hamo", "model_only") is None  # no default: unplanned
    assert Plan.parse([]).pair("hamo", "base") is None
    assert Plan.parse(["hamo_no_replay=4"]).pair("hamo_no_replay", "hamo") == 4  # any method a config names
    for bad, named in [
        (["six"], "expected N or method=N"),
        (["=3"], "expected N or method=N"),
        (["hamo_v2=6"], "unknown method 'hamo_v2'"),
        (["base=1"], "at least 2 seeds"),
        (["6", "5"], "two counts"),
    ]:
        with pytest.raises(ValueError, match=named):
            Plan.parse(bad)

    for seed in range(3):
        _cell(tmp_path, "hamo", seed, [40.0 + seed, 40.0])
        _cell(tmp_path, "model_only", seed, [30.0, 30.0 + seed])
        _cell(tmp_path, "base", seed, [5.0, 5.0])
    table = paired_table(load_cells(tmp_path), planned=plan)
    assert "| `hamo - base` | +35.0 | +35.5 | +36.0 | 35.5 ± 1.2 | decided: `hamo` above |" in table
    assert (
        "| `hamo - model_only` | +10.0 | +10.0 | +10.0 | 10.0 ± 0.0 | interim (3 of 6 seeds): excludes 0"
        in table
    )
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- BEGIN x -->\n<!-- END x -->\n")
    argv = [str(tmp_path), "--name", "x", "--doc", str(doc), "--planned-seeds", "6", "base=3"]
    assert main(argv) == 0
    assert "35.5 ± 1.2 | decided: `hamo` above |" in doc.read_text()
    assert "reads the decision rule at 6 seeds, `base` 3 (a pair: the smaller plan" in doc.read_text()
    assert Plan.parse([]).describe() == ""
    assert main([str(tmp_path), "--name", "x", "--planned-seeds", "6", "bsae=3"]) == 2
    assert "unknown method 'bsae'" in capsys.readouterr().out


def test_two_results_folders_make_one_section(tmp_path):
    """The powered design's trained cells and its flat methods are two sweeps with two results folders;
    one section pairs them by seed. A cell in both is refused, named."""
    trained, flat = tmp_path / "trained", tmp_path / "flat"
    _cell(trained, "hamo", 0, [30, 40])
    _cell(trained, "hamo", 1, [30, 30])
    _cell(flat, "base", 0, [10, 12])
    _cell(flat, "base", 1, [20, 20])
    cells = load_all([trained, flat])
    assert sorted((c["method"], c["seed"]) for c in cells) == [
        ("base", 0),
        ("base", 1),
        ("hamo", 0),
        ("hamo", 1),
    ]
    assert "`hamo - base` | +24.0 | +10.0 |" in paired_table(cells)
    doc = tmp_path / "results.md"
    doc.write_text("<!-- BEGIN both -->\n<!-- END both -->\n")
    assert main([str(trained), str(flat), "--name", "both", "--doc", str(doc)]) == 0
    assert "Finished cells: 4" in doc.read_text()
    _cell(flat, "hamo", 1, [0, 0])
    with pytest.raises(ValueError, match="hamo-s1 is in both"):
        load_all([trained, flat])
    assert main([str(trained), str(flat), "--name", "both", "--doc", str(doc)]) == 1


def test_a_design_that_decides_on_retention_reports_the_other_metrics_without_deciding(tmp_path, capsys):
    """The powered cross-domain rerun decides on first-domain retention only: at its 6 seeds the
    retention table decides, while the stage-average and last-domain tables say where their intervals
    lie and decide nothing (reading the rule on three scores would decide more often than its 95%).
    A metric the section does not pair, or no metric at all, is refused by name."""
    from hamo_ray.evaluation.metrics import mean_interval

    six = mean_interval([5.0, 6.0, 7.0, 5.5, 6.5, 6.0])
    assert reading(six, "hamo", "model_only", planned=6, decides=False) == (
        "reported, decides nothing: excludes 0, `hamo` above"
    )
    assert reading(mean_interval([5.0, -1.0]), "hamo", "model_only", decides=False) == (
        "reported, decides nothing: includes 0"
    )
    assert reading(mean_interval([5.0]), "hamo", "model_only", decides=False) == "one seed"

    cross = tmp_path / "cross"
    for seed in range(6):
        _cross_cell(cross, "hamo", seed, [30, 40, 35 + seed % 2])
        _cross_cell(cross, "model_only", seed, [30, 30, 5 + seed % 3])
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- BEGIN x -->\n<!-- END x -->\n")
    argv = [str(cross), "--name", "x", "--doc", str(doc), "--planned-seeds", "6"]
    assert main([*argv, "--decide-on", "first-domain retention"]) == 0
    text = doc.read_text()
    assert "The design decides on first-domain retention only" in text
    tables = {t.split("\n")[0]: t for t in text.split("\n\n") if t.startswith("| difference")}
    (retention,) = [t for h, t in tables.items() if "(first-domain retention)" in h]
    (average,) = [t for h, t in tables.items() if "(stage average)" in h]
    (last,) = [t for h, t in tables.items() if "(last-domain score)" in h]
    assert "| decided: `hamo` above |" in retention
    assert "| reported, decides nothing: excludes 0, `hamo` above |" in average
    assert "decided" not in average.replace("decides nothing", "")
    assert "| reported, decides nothing: includes 0 |" in last  # webshop scores 10 in every cell
    assert main(argv) == 0  # no --decide-on: every table decides, as before
    assert "| decided: `hamo` above |" in doc.read_text().split("(stage average)")[1].split("\n\n")[0]

    assert main([*argv, "--decide-on", "accuracy"]) == 2
    assert "--decide-on accuracy: not a metric" in capsys.readouterr().out
    within = tmp_path / "within"
    _cell(within, "hamo", 0, [30, 40])
    _cell(within, "model_only", 0, [20, 30])
    assert main([str(within), "--name", "x", "--decide-on", "first-domain retention"]) == 2
    assert not (within / "results").exists()  # refused before its plot was drawn
    out = capsys.readouterr().out
    assert "--decide-on first-domain retention: not paired in this section" in out
    assert "the stage average only" in out
    with pytest.raises(ValueError, match=r"--decide-on \(nothing\)"):
        section(load_cells(cross), "x", plot=None, decide_on=[])
    before = doc.read_text()
    assert main([*argv, "--decide-on", "last-domain scor"]) == 2
    assert doc.read_text() == before  # a refused run leaves the document as it was
