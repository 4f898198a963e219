"""Per-run plots and report.md, sweeps over any dotted key, and the jobs' --print-config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hamo_ray.config import ConfigError, load_config
from hamo_ray.evaluation.metrics import summarize
from hamo_ray.evaluation.plots import write_run_report
from hamo_ray.sweep import expand_cells, load_sweep, setting_of

ROOT = Path(__file__).resolve().parents[2]


def test_run_report_has_integer_stages_and_stage_zero(tmp_path):
    scores = [{"scienceworld": 40.0, "alfworld": 10.0}, {"scienceworld": 35.0, "alfworld": 30.0}]
    metrics = summarize(scores, ["scienceworld", "alfworld"], {"scienceworld": 20.0, "alfworld": 5.0})
    metrics["method"] = "hamo"
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "metrics.json").write_text(json.dumps(metrics))
    report = write_run_report(tmp_path).read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["0", "1", "2"]  # stage 0 = before training
    assert "| 1 | 10.00 | 40.00 |" in report  # domains sorted: alfworld, scienceworld
    for png in ("stagewise.png", "bars.png", "retention.png"):
        assert (tmp_path / "results" / png).stat().st_size > 5_000
        assert f"(results/{png})" in report


def test_sweep_varies_any_dotted_key(tmp_path):
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(
        yaml.safe_dump(
            {
                "base": str(ROOT / "jobs" / "configs" / "tiny.yaml"),
                "root": str(tmp_path / "runs"),
                "grid": {"method": ["hamo"], "seed": [0, 1], "vary": {"train.lr": [0.0002, 0.002]}},
            }
        )
    )
    sweep, base = load_sweep(sweep_file)
    cells = expand_cells(sweep, base)
    assert len(cells) == 4
    assert sorted({cfg.train.lr for _, cfg in cells}) == [0.0002, 0.002]
    assert len({name for name, _ in cells}) == 4 and all("-lr" in name for name, _ in cells)
    settings = {setting_of(cfg, ["train.lr"]) for _, cfg in cells}
    assert len(settings) == 2 and all("train.lr=" in s for s in settings)  # seeds pooled per lr

    sweep_file.write_text(yaml.safe_dump({"base": str(base), "grid": {"vary": {"train.nope": [1]}}}))
    with pytest.raises(ConfigError, match="train.nope"):
        expand_cells(*load_sweep(sweep_file))
    sweep_file.write_text("base: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_sweep(sweep_file)


def test_sweep_run_order_seed_runs_every_method_of_a_seed_first(tmp_path):
    sweep_file = tmp_path / "sweep.yaml"
    spec = {
        "base": str(ROOT / "jobs" / "configs" / "tiny.yaml"),
        "root": str(tmp_path / "runs"),
        "grid": {"method": ["model_only", "hamo"], "seed": [0, 1, 2]},
    }
    sweep_file.write_text(yaml.safe_dump(spec))
    grid = [(cfg.method.name, cfg.run.seed) for _, cfg in expand_cells(*load_sweep(sweep_file))]
    assert grid == [("model_only", s) for s in range(3)] + [("hamo", s) for s in range(3)]
    sweep, base = load_sweep(sweep_file, ["run_order=seed"])
    by_seed = [(cfg.method.name, cfg.run.seed) for _, cfg in expand_cells(sweep, base)]
    assert by_seed == [(m, s) for s in range(3) for m in ("model_only", "hamo")]
    with pytest.raises(ConfigError, match="run_order"):
        load_sweep(sweep_file, ["run_order=method"])


def test_print_config_prints_the_resolved_config():
    out = subprocess.run(
        [
            sys.executable,
            "jobs/stream.py",
            "--config",
            "jobs/configs/tiny.yaml",
            "train.epochs=1",
            "--print-config",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    expected = load_config(ROOT / "jobs" / "configs" / "tiny.yaml", ["train.epochs=1"])
    assert printed == expected.model_dump(mode="json")
    bad = subprocess.run(
        [
            sys.executable,
            "jobs/stream.py",
            "--config",
            "jobs/configs/tiny.yaml",
            "train.nope=1",
            "--print-config",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "train.nope" in bad.stderr and "Traceback" not in bad.stderr


def test_serve_print_config_prints_the_resolved_config_without_the_key(tmp_path):
    """jobs/serve.py --print-config: the run's config.yaml + overrides + flags, the API key masked; no Ray."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(load_config(ROOT / "jobs" / "configs" / "tiny.yaml").to_yaml())
    cmd = [sys.executable, "jobs/serve.py", "--run", str(run), "--port", "9123", "--api-key", "s3cret"]
    out = subprocess.run(
        [*cmd, "serve.num_replicas=2", "--print-config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "s3cret" not in out.stdout + out.stderr
    printed = yaml.safe_load(out.stdout)
    expected = load_config(run / "config.yaml", ["serve.num_replicas=2", "serve.port=9123"])
    assert printed["serve"]["api_key"] == "***"
    printed["serve"]["api_key"] = None
    assert printed == expected.model_dump(mode="json")

    bad = subprocess.run(
        [*cmd, "serve.nope=1", "--print-config"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "serve.nope" in bad.stderr and "Traceback" not in bad.stderr
    empty = subprocess.run(
        [sys.executable, "jobs/serve.py", "--run", str(tmp_path), "--print-config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert empty.returncode == 2 and "no config.yaml" in empty.stderr


def _tiny_cells(tmp_path: Path, grid: dict) -> list:
    """The cells of a sweep over tiny.yaml with ``grid``, rooted in ``tmp_path``."""
    sweep_file = tmp_path / "sweep.yaml"
    base = str(ROOT / "jobs" / "configs" / "tiny.yaml")
    sweep_file.write_text(yaml.safe_dump({"base": base, "root": str(tmp_path / "runs"), "grid": grid}))
    return expand_cells(*load_sweep(sweep_file))


def test_aggregate_leaves_out_unfinished_cells_and_reports_every_column(tmp_path):
    """A cell that failed or was interrupted after some stages does not enter the means (nor crash them)."""
    from hamo_ray.sweep import aggregate

    cells = _tiny_cells(tmp_path, {"method": ["hamo"], "seed": [0, 1, 2]})
    finished = {0: [30.0, 40.0], 1: [34.0, 38.0]}  # seed -> stage scores; seed 2 stopped after stage 0
    for name, cfg in cells:
        scores = [{"scienceworld": v} for v in finished.get(cfg.run.seed, [])]
        metrics = summarize(scores, ["scienceworld"] * len(scores), {"scienceworld": 20.0})
        path = Path(cfg.run.root) / name / "results" / "metrics.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(metrics))
    summary = aggregate(cells, tmp_path / "out")
    (row,) = summary.values()
    assert row["hamo"]["seeds"] == 2
    assert row["hamo"]["average"]["mean"] == pytest.approx((35.0 + 36.0) / 2)
    assert row["hamo"]["retention"][-1]["mean"] == pytest.approx(39.0)
    table = (tmp_path / "out" / "table.md").read_text()
    assert "first-domain retention" in table and "BWT" in table and "| hamo | 2 |" in table
    assert row["hamo"]["vs_base"]["n"] == 0  # no base method in this grid: nothing to pair with


def test_aggregate_pairs_each_method_with_base_of_the_same_seed(tmp_path):
    """Seed luck shared by the methods cancels in the paired difference to base."""
    from hamo_ray.sweep import aggregate

    cells = _tiny_cells(tmp_path, {"method": ["base", "hamo"], "seed": [0, 1, 2]})
    luck = {0: 0.0, 1: 10.0, 2: -10.0}
    for name, cfg in cells:
        v = 30.0 + luck[cfg.run.seed] + (3.0 if cfg.method.name == "hamo" else 0.0)
        metrics = summarize([{"scienceworld": v}, {"scienceworld": v}], ["scienceworld"] * 2, None)
        path = Path(cfg.run.root) / name / "results" / "metrics.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(metrics))
    (row,) = aggregate(cells, tmp_path / "out").values()
    assert row["hamo"]["average"]["ci_high"] - row["hamo"]["average"]["mean"] > 20  # wide: seed luck
    assert row["hamo"]["vs_base"]["mean"] == pytest.approx(3.0)
    assert row["hamo"]["vs_base"]["std"] == pytest.approx(0.0)  # paired: the luck cancels
    assert row["base"]["vs_base"]["mean"] == pytest.approx(0.0)


def test_learning_benchmark_tables_a_finished_sweep(tmp_path):
    """benchmarks/learning.py --aggregate-only: one row per method of the sweep's summary, run nothing."""
    from hamo_ray.sweep import aggregate

    cells = _tiny_cells(tmp_path, {"method": ["base", "hamo"], "seed": [0, 1]})
    for name, cfg in cells:
        v = 30.0 + cfg.run.seed + (4.0 if cfg.method.name == "hamo" else 0.0)
        metrics = summarize([{"scienceworld": v}, {"scienceworld": v + 1}], ["scienceworld"] * 2, None)
        path = Path(cfg.run.root) / name / "results" / "metrics.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(metrics))
    aggregate(cells, tmp_path / "runs" / "results")
    out_json = tmp_path / "learning.json"
    sweep = str(tmp_path / "sweep.yaml")
    cmd = [
        sys.executable,
        "benchmarks/learning.py",
        "--aggregate-only",
        "--sweeps",
        sweep,
        "--json",
        str(out_json),
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = {r["method"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert set(rows) == {"base", "hamo"} and rows["hamo"]["seeds"] == 2
    assert rows["hamo"]["vs_base"]["mean"] == pytest.approx(4.0)
    assert rows["hamo"]["before"] == {"scienceworld": pytest.approx(34.5)}  # stage 1, no initial evaluation
    line = next(x for x in out.stdout.splitlines() if x.split()[:2] == ["sweep", "hamo"])
    assert "35.0 ± " in line and "4.0 ± 0.0" in line


def test_backbone_probe_never_evaluates_the_test_split(tmp_path, monkeypatch):
    """benchmarks/backbone_probe.py: stage 0 only, as ``base``, on train-split tasks, in its own run folder."""
    import importlib

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    probe_mod = importlib.import_module("backbone_probe")
    cfg = probe_mod.probe_config(str(ROOT / "jobs/configs/tiny.yaml"), ["method.name=hamo"], 3, str(tmp_path))
    assert cfg.method.name == "base" and cfg.protocol.eval_initial and cfg.run.resume
    assert cfg.run.id.endswith("-train3") and cfg.run.id.startswith("scienceworld-")
    probe = probe_mod.make_probe(cfg)
    assert probe.expected_stages == [0]
    tasks = probe.test_tasks["scienceworld"]
    assert {t.split for t in tasks} == {"train"}
    assert len(tasks) == 3 * len(cfg.task_types("scienceworld"))
    assert probe.folder.path == tmp_path / cfg.run.id
    # One BC stage: trained on the first 2 train variations of each type, probed on the 3 after them.
    bc = probe_mod.probe_config(str(ROOT / "jobs/configs/tiny.yaml"), [], 3, str(tmp_path), after_bc=2)
    assert bc.method.name == "agenttuning" and bc.protocol.num_stages == 1 and bc.run.id.endswith("-bc2")
    probe = probe_mod.make_probe(bc, 3)
    assert probe.expected_stages == [0, 1]
    trained = {t.id for stage in probe.stage_tasks for t in stage}
    probed = probe.test_tasks["scienceworld"]
    assert {t.split for t in probed} == {"train"} and len(probed) == 3 * len(bc.task_types("scienceworld"))
    assert len(trained) == 2 * len(bc.task_types("scienceworld")) and not trained & {t.id for t in probed}
    with pytest.raises(ConfigError, match="within_domain"):
        probe_mod.probe_config(str(ROOT / "jobs/configs/tiny-cross.yaml"), [], 3, str(tmp_path), after_bc=2)
