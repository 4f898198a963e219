"""A sweep's tracked ``results`` folder: cells exported as they finish, skipped when exported (also on a
fresh machine without their run folders), run again when the export is stale, and aggregated from it.

No Ray and no model: the run folders are written here (``RunFolder`` with a real tiny.yaml config)."""

from __future__ import annotations

import csv
import gzip
import importlib.util
import json
import logging
import shutil
from pathlib import Path

import pytest
import yaml

from hamo_ray.config import ConfigError
from hamo_ray.run.folder import RunFolder
from hamo_ray.run.stream import Stream
from hamo_ray.sweep import (
    aggregate,
    cells_to_run,
    expand_cells,
    export_cell,
    export_dir,
    export_finished,
    exported_cell,
    load_sweep,
    results_dir,
    stale_keys,
)
from hamo_ray.types import StageResult, TaskSpec, Trajectory

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "jobs" / "configs" / "tiny.yaml")


def _sweep(tmp_path: Path, grid: dict | None = None, **keys):
    """A sweep over tiny.yaml rooted at ``tmp_path/runs`` with ``results`` at ``tmp_path/results``.

    Returns:
        The sweep, its cells and the sweep file.
    """
    f = tmp_path / "sweep.yaml"
    data = {
        "base": TINY,
        "root": str(tmp_path / "runs"),
        "results": str(tmp_path / "results"),
        "grid": grid or {"method": ["base", "hamo"], "seed": [0]},
        **keys,
    }
    f.write_text(yaml.safe_dump(data))
    sweep, base = load_sweep(f)
    return sweep, expand_cells(sweep, base), f


def _episode(task: str, variation: int, score: float, turns: int, **kw) -> Trajectory:
    return Trajectory(
        task=TaskSpec(domain="scienceworld", task=task, variation=variation, split="test"),
        goal="g",
        init_obs="o",
        actions=[f"a{i}" for i in range(turns)],
        observations=[f"o{i}" for i in range(turns)],
        score=score,
        **kw,
    )


def _finish(name: str, cfg, scores=(30.0, 40.0), episodes: bool = True) -> Path:
    """A finished run folder of cell ``name``: config, state, results, report, episodes, and the large
    outputs an export must leave behind (adapters, memory, train, tensorboard, trajectories)."""
    folder = RunFolder(Path(cfg.run.root) / name, cfg)
    folder.prepare()
    stages = [
        StageResult(
            stage=t,
            method=cfg.method.name,
            domain="scienceworld",
            num_trajectories=2,
            num_cards=1,
            budget=2,
            anchors=[],
            replay=[],
            adapter=None,
            adapter_name=None,
            train_loss=None,
            scores={"scienceworld": v},
            seconds={"evaluate": 1.0},
            evaluation={"episodes/scienceworld": 2.0, "failed/scienceworld": 0.0},
        )
        for t, v in enumerate(scores, start=1)
    ]
    (folder.path / "state.json").write_text(
        json.dumps({"stages": [s.model_dump(mode="json") for s in stages]})
    )
    folder.write_results(stages)  # scores.csv, metrics.json, report.md and the run's plots
    if episodes:
        for t in range(1, len(scores) + 1):
            folder.save_episodes(
                t,
                "scienceworld",
                [
                    _episode(
                        "find-living-thing",
                        3,
                        100.0,
                        4,
                        done=True,
                        cards_used=["c1", "c2"],
                        policy_tokens=57,
                        cards_withheld=3,
                    ),
                    _episode("lifespan-longest-lived", 7, 0.0, 0, error="env crashed\nat step 0"),
                ],
            )
    for big in ("adapters/stage-1", "memory", "train", "tensorboard", "trajectories"):
        (folder.path / big).mkdir(parents=True, exist_ok=True)
        (folder.path / big / "blob.bin").write_bytes(b"x" * 100)
    return folder.path


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def test_export_copies_the_small_results_and_nothing_else(tmp_path):
    sweep, cells, _ = _sweep(tmp_path)
    name, cfg = cells[0]
    run = _finish(name, cfg)
    dest = export_cell(run, export_dir(results_dir(sweep), name))
    assert dest == tmp_path / "results" / "cells" / name
    assert _files(dest) == {
        "config.yaml",
        "state.json",
        "report.md",
        "results/scores.csv",
        "results/metrics.json",
        "episodes/stage-1-scienceworld.jsonl.gz",
        "episodes/stage-2-scienceworld.jsonl.gz",
        "episodes.csv",
    }  # no adapters, memory, train, tensorboard, trajectories, plots
    for rel in ("config.yaml", "state.json", "report.md", "results/scores.csv", "results/metrics.json"):
        assert (dest / rel).read_bytes() == (run / rel).read_bytes(), rel
    raw = (run / "episodes" / "stage-1-scienceworld.jsonl").read_bytes()
    assert gzip.decompress((dest / "episodes" / "stage-1-scienceworld.jsonl.gz").read_bytes()) == raw
    assert exported_cell(tmp_path / "results", name) == dest
    assert list((tmp_path / "results" / "cells").iterdir()) == [dest]  # no temporary folder left


def test_episodes_csv_has_one_row_per_episode(tmp_path):
    sweep, cells, _ = _sweep(tmp_path)
    name, cfg = cells[0]
    dest = export_cell(_finish(name, cfg), export_dir(results_dir(sweep), name))
    with (dest / "episodes.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == [
        "stage",
        "domain",
        "split",
        "task",
        "variation",
        "score",
        "turns",
        "done",
        "error",
        "cards_used",
        "policy_tokens",
        "cards_withheld",
    ]
    assert len(rows) == 4  # 2 stages x 2 episodes
    assert [r["stage"] for r in rows] == ["1", "1", "2", "2"]
    ok, failed = rows[:2]
    assert ok == {
        "stage": "1",
        "domain": "scienceworld",
        "split": "test",
        "task": "find-living-thing",
        "variation": "3",
        "score": "100.0",
        "turns": "4",
        "done": "True",
        "error": "",
        "cards_used": "2",
        "policy_tokens": "57",
        "cards_withheld": "3",
    }
    assert (
        failed["error"] == "env crashed\nat step 0" and failed["turns"] == "0" and failed["done"] == "False"
    )
    assert failed["cards_used"] == "0" and failed["score"] == "0.0"


def test_episodes_csv_labels_domain_and_split_as_the_report(tmp_path):
    """ALFWorld's seen-room episodes (``protocol.eval_seen``: the dev games) count towards the report's
    ``alfworld@seen`` column, not ``alfworld``; the split column tells them apart too."""
    from hamo_ray.evaluation.metrics import SEEN
    from hamo_ray.sweep.export import write_episodes_csv

    sweep, cells, _ = _sweep(tmp_path)
    name, cfg = cells[0]
    run = _finish(name, cfg)
    folder = RunFolder(run, cfg)
    for split, column in (("test", "alfworld"), ("dev", f"alfworld{SEEN}")):
        ep = _episode("pick_and_place_simple", 2, 100.0, 3)
        ep = ep.model_copy(
            update={"task": TaskSpec(domain="alfworld", task=ep.task.task, variation=2, split=split)}
        )
        folder.save_episodes(1, column, [ep])
    dest = export_cell(run, export_dir(results_dir(sweep), name))
    with (dest / "episodes.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r["task"] == "pick_and_place_simple"]
    assert [(r["domain"], r["split"]) for r in rows] == [("alfworld", "test"), ("alfworld@seen", "dev")]
    # an export made before the split column is written again from its episodes
    before = (dest / "episodes.csv").read_text()
    (dest / "episodes.csv").write_text("stage,domain\n")
    assert write_episodes_csv(dest).read_text() == before


def test_a_committed_export_written_before_the_split_column_gets_the_reports_labels(tmp_path):
    """The committed cross-domain cells: their episodes.csv rebuilt labels the seen rooms as the report."""
    from hamo_ray.sweep.export import write_episodes_csv

    cell = next((ROOT / "results" / "smollm2-cross" / "cells").glob("hamo-*-s0"))
    copy = tmp_path / cell.name
    shutil.copytree(cell, copy)
    old = list(csv.DictReader((cell / "episodes.csv").open()))
    assert "split" not in old[0]  # as committed: the seen rooms labelled "alfworld"
    with write_episodes_csv(copy).open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(old)
    labels = {(r["domain"], r["split"]) for r in rows}
    assert ("alfworld@seen", "dev") in labels and ("alfworld", "test") in labels
    assert ("alfworld", "dev") not in labels and ("alfworld@seen", "test") not in labels
    metrics = json.loads((cell / "results" / "metrics.json").read_text())
    by: dict = {}
    for r in rows:
        by.setdefault((int(r["stage"]), r["domain"]), []).append(float(r["score"]))
    for (stage, domain), scores in by.items():  # each (stage, domain) mean is the report's score
        want = metrics["initial"][domain] if stage == 0 else metrics["stage_scores"][domain][stage - 1]
        assert sum(scores) / len(scores) == pytest.approx(want, abs=1e-6), (stage, domain)


def test_the_committed_smollm2_exports_were_made_with_key_selection(tmp_path):
    """The committed SmolLM2 cells were selected by key (before ``selection.embed`` existed): read so,
    they count as finished under a config that says ``selection.embed=key`` and are stale, naming that
    key alone, under the new default (a rerun selects by card, and the two are never aggregated)."""
    from hamo_ray.sweep.export import cell_metrics

    results = ROOT / "results" / "smollm2-within"
    exported = next((results / "cells").glob("hamo-*-s0"))
    assert "embed" not in yaml.safe_load((exported / "config.yaml").read_text())["selection"]
    sweep, base = load_sweep(ROOT / "jobs" / "configs" / "sweep-smollm2-within.yaml")
    (cfg,) = [c for name, c in expand_cells(sweep, base) if name == exported.name]
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"root": str(tmp_path / "runs")})})
    key = cfg.model_copy(update={"selection": cfg.selection.model_copy(update={"embed": "key"})})
    card = cfg.model_copy(update={"selection": cfg.selection.model_copy(update={"embed": "card"})})
    assert stale_keys(exported, key) == []
    metrics = cell_metrics(exported.name, key, results)
    assert metrics is not None and metrics == json.loads((exported / "results" / "metrics.json").read_text())
    assert stale_keys(exported, card) == ["selection.embed"]
    assert cell_metrics(exported.name, card, results) is None


def test_a_run_folder_without_episodes_exports_an_empty_summary(tmp_path):
    sweep, cells, _ = _sweep(tmp_path)
    name, cfg = cells[0]
    dest = export_cell(_finish(name, cfg, episodes=False), export_dir(results_dir(sweep), name))
    assert (dest / "episodes.csv").read_text().splitlines() == [
        "stage,domain,split,task,variation,score,turns,done,error,cards_used,policy_tokens,cards_withheld"
    ]
    assert not (dest / "episodes").exists()
    other, other_cfg = cells[1]
    RunFolder(Path(other_cfg.run.root) / other, other_cfg).prepare()  # started, no stage yet
    with pytest.raises(FileNotFoundError, match="metrics.json"):
        export_cell(Path(other_cfg.run.root) / other, export_dir(results_dir(sweep), other))
    assert exported_cell(results_dir(sweep), other) is None


def test_exporting_again_replaces_the_export(tmp_path):
    sweep, cells, _ = _sweep(tmp_path)
    name, cfg = cells[0]
    run = _finish(name, cfg)
    dest = export_dir(results_dir(sweep), name)
    export_cell(run, dest)
    (dest / "stray.txt").write_text("from an older export\n")
    (run / "report.md").unlink()
    (run / "results" / "metrics.json").write_text('{"changed": true}')
    export_cell(run, dest)
    assert not (dest / "stray.txt").exists() and not (dest / "report.md").exists()
    assert json.loads((dest / "results" / "metrics.json").read_text()) == {"changed": True}
    assert sorted(p.name for p in dest.parent.iterdir()) == [name]


def test_a_cell_whose_export_exists_is_not_run_again_on_a_fresh_machine(tmp_path):
    sweep, cells, _ = _sweep(tmp_path)
    (done_name, done_cfg), (todo_name, _) = cells
    export_cell(_finish(done_name, done_cfg), export_dir(results_dir(sweep), done_name))
    shutil.rmtree(tmp_path / "runs")  # a fresh machine: no run folders
    streams = {name: Stream(cfg) for name, cfg in cells}
    assert not streams[done_name].finished
    assert cells_to_run(sweep, cells, streams) == [todo_name]
    without = sweep.model_copy(update={"results": None})  # the same sweep without `results`: both run
    assert cells_to_run(without, cells, streams) == [done_name, todo_name]


def test_a_stale_export_runs_again_naming_the_differing_key(tmp_path, caplog):
    sweep, cells, _ = _sweep(tmp_path)
    name, cfg = cells[0]
    dest = export_cell(_finish(name, cfg), export_dir(results_dir(sweep), name))
    shutil.rmtree(tmp_path / "runs")
    streams = {n: Stream(c) for n, c in cells}
    saved = yaml.safe_load((dest / "config.yaml").read_text())
    # Keys a resume may change do not make an export stale: run (root included), ray, serve, rollout.
    saved["run"]["root"] = "/elsewhere/cells"
    saved["serve"]["port"] = saved["serve"]["port"] + 1
    saved["rollout"]["num_workers"] = 7
    saved["ray"]["num_cpus"] = 3
    (dest / "config.yaml").write_text(yaml.safe_dump(saved))
    assert stale_keys(dest, cfg) == []
    assert name not in cells_to_run(sweep, cells, streams)
    saved["train"]["lr"] = cfg.train.lr * 10
    saved["protocol"]["test_per_task"] = cfg.protocol.test_per_task + 1
    (dest / "config.yaml").write_text(yaml.safe_dump(saved))
    assert stale_keys(dest, cfg) == ["protocol.test_per_task", "train.lr"]
    with caplog.at_level(logging.WARNING, logger="hamo_ray.sweep"):
        assert name in cells_to_run(sweep, cells, streams)
    (warning,) = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert "protocol.test_per_task, train.lr" in warning and "again" in warning
    # A key the export lacks was added to the code later: it holds its code default.
    assert cfg.memory == type(cfg.memory)() and cfg.train.lr != type(cfg.train)().lr  # tiny.yaml's 2e-3
    del saved["protocol"]["test_per_task"], saved["memory"], saved["train"]["lr"]
    saved["protocol"]["test_per_task"] = cfg.protocol.test_per_task
    (dest / "config.yaml").write_text(yaml.safe_dump(saved))
    assert stale_keys(dest, cfg) == ["train.lr"]  # the default lr is not the cell's; memory's are


def test_a_half_written_export_does_not_count_as_finished(tmp_path, monkeypatch):
    sweep, cells, _ = _sweep(tmp_path)
    name, cfg = cells[0]
    run = _finish(name, cfg)
    dest = export_dir(results_dir(sweep), name)
    real_copy = shutil.copyfile
    copied = []

    def dies_after_two(src, dst, *a, **kw):  # the export is killed while copying
        if len(copied) == 2:
            raise KeyboardInterrupt
        copied.append(dst)
        return real_copy(src, dst, *a, **kw)

    monkeypatch.setattr(shutil, "copyfile", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        export_cell(run, dest)
    monkeypatch.undo()
    tmp = dest.with_name(f".{name}.tmp")
    assert tmp.is_dir() and not dest.exists()
    # Even a temporary folder holding what a finished export holds is not an export.
    real_copy(run / "results" / "metrics.json", tmp / "results" / "metrics.json")
    assert (tmp / "config.yaml").exists() and exported_cell(results_dir(sweep), name) is None
    shutil.rmtree(tmp_path / "runs")
    streams = {n: Stream(c) for n, c in cells}
    assert cells_to_run(sweep, cells, streams) == [n for n, _ in cells]
    # The next export of the cell clears the leftover.
    export_cell(_finish(name, cfg), dest)
    assert not tmp.exists() and exported_cell(results_dir(sweep), name) == dest


def test_cells_finished_before_results_was_set_are_exported_at_start(tmp_path):
    sweep, cells, _ = _sweep(tmp_path)
    (done_name, done_cfg), (other, _) = cells
    _finish(done_name, done_cfg)
    streams = {name: Stream(cfg) for name, cfg in cells}
    assert export_finished(sweep, cells, streams) == [done_name]
    assert exported_cell(results_dir(sweep), done_name) is not None
    assert exported_cell(results_dir(sweep), other) is None
    assert export_finished(sweep, cells, streams) == []  # already exported, of this very run folder
    assert export_finished(sweep.model_copy(update={"results": None}), cells, streams) == []


def test_aggregate_reads_the_exports_when_the_run_folders_are_gone(tmp_path):
    sweep, cells, _ = _sweep(tmp_path, {"method": ["base", "hamo"], "seed": [0, 1]})
    for name, cfg in cells:
        bonus = 5.0 if cfg.method.name == "hamo" else 0.0
        run = _finish(name, cfg, scores=(30.0 + cfg.run.seed + bonus, 40.0 + bonus), episodes=False)
        export_cell(run, export_dir(results_dir(sweep), name))
    with_runs = aggregate(cells, tmp_path / "runs" / "results", [], results_dir(sweep))
    shutil.rmtree(tmp_path / "runs")
    out = tmp_path / "runs" / "results"
    summary = aggregate(cells, out, [], results_dir(sweep))
    assert summary == with_runs
    (row,) = summary.values()
    assert row["hamo"]["seeds"] == 2 and row["base"]["seeds"] == 2
    assert row["hamo"]["vs_base"]["mean"] == pytest.approx(5.0)
    results = tmp_path / "results"
    assert json.loads((results / "summary.json").read_text()) == summary
    assert (results / "table.md").read_text() == (out / "table.md").read_text()
    report = (results / "report.md").read_text()
    assert "](setting0-stagewise.png)" in report and (results / "setting0-stagewise.png").is_file()
    assert "](results/setting0-stagewise.png)" in (tmp_path / "runs" / "report.md").read_text()


def test_aggregate_without_results_writes_nothing_else(tmp_path):
    sweep, cells, _ = _sweep(tmp_path, results=None)
    assert sweep.results is None and results_dir(sweep) is None
    for name, cfg in cells:
        _finish(name, cfg, episodes=False)
    summary = aggregate(cells, tmp_path / "runs" / "results")
    assert len(summary) == 1 and not (tmp_path / "results").exists()
    assert {p.name for p in (tmp_path / "runs").iterdir()} == {"cells", "results", "report.md"}


def test_aggregate_leaves_out_a_stale_export(tmp_path, caplog):
    sweep, cells, _ = _sweep(tmp_path, {"method": ["hamo"], "seed": [0]})
    ((name, cfg),) = cells
    dest = export_cell(_finish(name, cfg, episodes=False), export_dir(results_dir(sweep), name))
    shutil.rmtree(tmp_path / "runs")
    saved = yaml.safe_load((dest / "config.yaml").read_text())
    saved["train"]["epochs"] = cfg.train.epochs + 1
    (dest / "config.yaml").write_text(yaml.safe_dump(saved))
    with caplog.at_level(logging.WARNING, logger="hamo_ray.sweep"):
        assert aggregate(cells, tmp_path / "runs" / "results", [], results_dir(sweep)) == {}
    assert any("train.epochs" in r.getMessage() and name in r.getMessage() for r in caplog.records)


def test_results_that_is_a_file_or_the_root_is_refused(tmp_path):
    (tmp_path / "a-file").write_text("x\n")
    for bad in ("a-file", "a-file/below", "runs"):
        with pytest.raises(ConfigError, match="results"):
            _sweep(tmp_path, results=str(tmp_path / bad))
    sweep, _, f = _sweep(tmp_path, results="results/relative")
    assert results_dir(sweep) == Path("results/relative")  # relative to the current directory, like root
    assert load_sweep(f, ["results=null"])[0].results is None


def _jobs_sweep():
    spec = importlib.util.spec_from_file_location("jobs_sweep_under_test", ROOT / "jobs" / "sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_job_runs_nothing_when_every_cell_is_exported(tmp_path, monkeypatch, capsys):
    """jobs/sweep.py on a fresh machine: every cell exported, no run folder; it starts no Ray, runs
    nothing and aggregates from the exports."""
    sweep, cells, f = _sweep(tmp_path)
    for name, cfg in cells:
        export_cell(_finish(name, cfg, episodes=False), export_dir(results_dir(sweep), name))
    shutil.rmtree(tmp_path / "runs")
    job = _jobs_sweep()

    def no_ray(*a, **kw):
        raise AssertionError("a sweep with every cell exported must not run any")

    monkeypatch.setattr(job, "run_cells", no_ray)
    monkeypatch.setattr("hamo_ray.run.cluster.start_ray", no_ray)
    assert job.main(["--config", str(f)]) == 0
    out = capsys.readouterr().out
    assert "| base |" in out and "| hamo |" in out and f"results: {tmp_path / 'results'}" in out
    assert (tmp_path / "results" / "summary.json").is_file()


def test_the_job_refuses_a_relative_results_in_a_ray_job(tmp_path, monkeypatch, capsys):
    _, _, f = _sweep(tmp_path, results="results/relative")
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"working_dir": "."}}))
    assert _jobs_sweep().main(["--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert "results: 'results/relative' is relative" in err
