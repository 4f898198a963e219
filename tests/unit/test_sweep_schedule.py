"""The sweep's scheduler (``hamo_ray.sweep.runner``) with fakes: no Ray, no endpoint, no stream.

One endpoint per backbone shared by its cells, at most ``parallel`` cells at once, a failed cell's
traceback in its folder while the others go on, a finished cell exported at once, every endpoint
stopped; and which cells are left to run.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import yaml

from hamo_ray.config import ConfigError, HamoConfig, load_config
from hamo_ray.sweep import cells_to_run, export_cell, export_dir, load_sweep, results_dir
from hamo_ray.sweep import runner as sweep_runner

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "jobs" / "configs" / "tiny.yaml")


class FakeStream:
    """What the scheduler asks of a ``Stream``: finished?, its folder, its backbone."""

    def __init__(self, folder: Path, backbone: str | Exception = "/bb/a", finished: bool = False):
        self.folder = types.SimpleNamespace(path=folder, stages=list)  # a fresh run folder
        self.backbone = backbone
        self.finished = finished

    def prepare_backbone(self) -> str:
        if isinstance(self.backbone, Exception):
            raise self.backbone
        return self.backbone


class Ref:
    """A fake object ref: one per task (refs are dict keys), holding its result or its exception."""

    def __init__(self, kind: str, value):
        self.kind, self.value = kind, value


class FakeRay(types.ModuleType):
    """``ray.remote(f).options(...).remote(*args)`` runs ``f`` at once; ``wait`` returns the oldest ref."""

    def __init__(self):
        super().__init__("ray")
        self.options_seen: dict = {}
        self.in_flight = 0
        self.max_in_flight = 0

    def remote(self, fn):
        fake = self

        class Task:
            def options(self, **kw):
                fake.options_seen = kw
                return self

            def remote(self, *args):
                fake.in_flight += 1
                fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    return Ref("ok", fn(*args))
                except Exception as exc:  # noqa: BLE001 - raised again by get, as Ray does
                    return Ref("err", exc)

        return Task()

    def wait(self, refs, num_returns=1):
        return refs[:num_returns], refs[num_returns:]

    def get(self, ref):
        self.in_flight -= 1
        if ref.kind == "err":
            raise ref.value
        return ref.value


def _sweep(tmp_path: Path, **keys):
    f = tmp_path / "sweep.yaml"
    data = {"base": TINY, "root": str(tmp_path / "runs"), "grid": {"method": ["base"], "seed": [0]}, **keys}
    f.write_text(yaml.safe_dump(data))
    return load_sweep(f)[0]


@pytest.fixture
def fakes(monkeypatch):
    """A fake ``ray``, fake endpoints (recorded) and a fake ``run_cell`` (the cell named ``bad`` raises)."""
    import hamo_ray.run.services  # noqa: F401  (the real module, imported before ``ray`` is faked)

    ray = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", ray)
    log = {"started": [], "stopped": [], "ran": []}

    def start(cfg, path, n):
        log["started"].append((path, n))
        return f"http://endpoint-{n}"

    def stop(cfg, n):
        log["stopped"].append(n)
        if n == 1:
            raise RuntimeError("never came up")  # logged, the others still stopped

    def run_cell(cfg_json, url):
        cfg = HamoConfig.model_validate_json(cfg_json)
        log["ran"].append((cfg.run.id, url))
        if cfg.run.id == "bad":
            raise KeyError("x")
        return 2

    monkeypatch.setattr("hamo_ray.run.serve_apps.start_shared_policy", start)
    monkeypatch.setattr("hamo_ray.run.serve_apps.stop_shared_policy", stop)
    monkeypatch.setattr(sweep_runner, "run_cell", run_cell)
    return ray, log


def _cells(tmp_path: Path, names: list[str]):
    return [(n, load_config(TINY, [f"run.root={tmp_path / 'runs'}", f"run.id={n}"])) for n in names]


def test_cells_share_one_endpoint_per_backbone_and_fail_alone(tmp_path, fakes):
    ray, log = fakes
    sweep = _sweep(tmp_path, parallel=2, cell_resources={"CPU": 0.5, "GPU": 1, "big_node": 0.1})
    names = ["a", "b", "bad", "nobackbone", "c"]
    cells = _cells(tmp_path, names)
    streams = {n: FakeStream(tmp_path / "runs" / n, backbone="/bb/a" if n != "c" else "/bb/c") for n in names}
    streams["nobackbone"].backbone = FileNotFoundError("no expert data")
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "error.txt").write_text("an earlier try\n")

    failed = sweep_runner.run_cells(sweep, cells, streams, names)

    assert failed == ["nobackbone", "bad"]
    assert log["started"] == [("/bb/a", 0), ("/bb/c", 1)]  # one endpoint per backbone
    assert log["ran"] == [("a", "http://endpoint-0"), ("b", "http://endpoint-0"), ("bad", "http://endpoint-0"),
                          ("c", "http://endpoint-1")]  # fmt: skip
    assert log["stopped"] == [0, 1]  # every endpoint, though stopping one raised
    assert ray.max_in_flight <= 2
    assert ray.options_seen == {"resources": {"big_node": 0.1}, "num_cpus": 0.5, "num_gpus": 1}
    assert not (tmp_path / "runs" / "a" / "error.txt").exists()  # a finished cell drops an earlier error
    bad = (tmp_path / "runs" / "bad" / "error.txt").read_text()
    assert "KeyError: 'x'" in bad and "Traceback" in bad
    assert "FileNotFoundError: no expert data" in (tmp_path / "runs" / "nobackbone" / "error.txt").read_text()


def test_parallel_one_runs_one_cell_at_a_time_and_logs_its_pace(tmp_path, fakes, caplog):
    ray, log = fakes
    cells = _cells(tmp_path, ["a", "b", "c"])
    streams = {n: FakeStream(tmp_path / "runs" / n) for n, _ in cells}
    with caplog.at_level("INFO", logger="hamo_ray.sweep"):
        assert sweep_runner.run_cells(_sweep(tmp_path), cells, streams, ["c", "a"]) == []
    assert [name for name, _ in log["ran"]] == ["c", "a"] and ray.max_in_flight == 1
    assert "1 of 2 cells done, 1 left" in caplog.text and "2 of 2 cells done, 0 left (~0.0 h" in caplog.text


def test_pace_says_the_time_left_at_the_mean_cell_time():
    now = [0.0]
    pace = sweep_runner.Pace(total=5, parallel=2, clock=lambda: now[0])
    pace.started("a"), pace.started("b"), pace.started("bad")
    now[0] = 1800.0
    assert pace.finished("a") == "it took 30.0 min; 1 of 5 cells done, 4 left (~1.0 h at 30.0 min a cell)"
    pace.failed("bad")  # out of the count: 3 left of 4
    now[0] = 5400.0
    assert pace.finished("b") == "it took 90.0 min; 2 of 4 cells done, 2 left (~1.0 h at 60.0 min a cell)"


def test_a_resumed_cell_counts_as_done_but_not_in_the_pace(tmp_path):
    now = [0.0]
    pace = sweep_runner.Pace(total=3, clock=lambda: now[0])
    pace.started("a", resumed=True)
    now[0] = 600.0
    assert pace.finished("a") == (
        "this attempt took 10.0 min (resumed: not counted in the pace); 1 of 3 cells done, 2 left"
        " (no cell run whole yet: pace unknown)"
    )
    pace.started("b")
    now[0] = 2400.0
    assert pace.finished("b") == "it took 30.0 min; 2 of 3 cells done, 1 left (~0.5 h at 30.0 min a cell)"
    # A run folder resumes when its state lists a committed stage (stage 0 included).
    import json

    from hamo_ray.config import HamoConfig
    from hamo_ray.run.folder import RunFolder
    from hamo_ray.types import StageResult

    folder = RunFolder(tmp_path, HamoConfig())
    assert not sweep_runner._resumed(folder)
    folder.state_file.write_text('{"stages": []}')
    assert not sweep_runner._resumed(folder)
    stage0 = StageResult.initial("hamo", {"scienceworld": 6.8}, {"evaluate": 1.0}, {})
    folder.state_file.write_text(json.dumps({"stages": [stage0.model_dump(mode="json")]}))
    assert sweep_runner._resumed(folder)
    folder.state_file.write_text("{torn")
    assert not sweep_runner._resumed(folder)


def test_a_finished_cell_is_exported_at_once(tmp_path, fakes, monkeypatch):
    _, log = fakes
    sweep = _sweep(tmp_path, results=str(tmp_path / "results"))
    cells = _cells(tmp_path, ["a", "bad"])
    streams = {n: FakeStream(tmp_path / "runs" / n) for n, _ in cells}
    exported = []
    monkeypatch.setattr(
        sweep_runner, "save_export", lambda results, name, folder: exported.append((results, name))
    )
    assert sweep_runner.run_cells(sweep, cells, streams, ["a", "bad"]) == ["bad"]
    assert exported == [(tmp_path / "results", "a")]  # the failed cell is not exported


def test_endpoints_are_stopped_when_the_loop_raises(tmp_path, fakes, monkeypatch):
    ray, log = fakes
    cells = _cells(tmp_path, ["a"])
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns=1: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        sweep_runner.run_cells(_sweep(tmp_path), cells, {"a": FakeStream(tmp_path / "runs" / "a")}, ["a"])
    assert log["stopped"] == [0]


def test_record_failure_writes_the_traceback(tmp_path):
    failed: list[str] = []
    try:
        raise ValueError("bad value")
    except ValueError as exc:
        sweep_runner.record_failure("x", tmp_path / "deep" / "x", exc, failed)
    assert failed == ["x"]
    text = (tmp_path / "deep" / "x" / "error.txt").read_text()
    assert text.startswith("Traceback") and text.rstrip().endswith("ValueError: bad value")


def test_cells_to_run_skips_finished_and_exported_cells(tmp_path):
    sweep = _sweep(tmp_path, results=str(tmp_path / "results"))
    cells = _cells(tmp_path, ["done", "exported", "stale", "todo", "half"])
    cfgs = dict(cells)
    for name in ("exported", "stale", "half"):
        run = tmp_path / "runs" / name
        (run / "results").mkdir(parents=True)
        (run / "config.yaml").write_text(cfgs[name].to_yaml())
        (run / "results" / "metrics.json").write_text("{}")
        export_cell(run, export_dir(results_dir(sweep), name))
    (export_dir(results_dir(sweep), "half") / "results" / "metrics.json").unlink()  # not a finished export
    stale = export_dir(results_dir(sweep), "stale") / "config.yaml"
    stale.write_text(stale.read_text().replace("epochs: 3", "epochs: 9"))
    streams = {n: FakeStream(tmp_path / "runs" / n, finished=n == "done") for n, _ in cells}
    assert cells_to_run(sweep, cells, streams) == ["stale", "todo", "half"]


def test_prepare_cells_refuses_an_adapter_store(tmp_path):
    sweep = _sweep(tmp_path, overrides=[f"serve.adapter_store={tmp_path / 'store'}"])
    with pytest.raises(ConfigError, match="serve.adapter_store is not supported in a sweep"):
        sweep_runner.prepare_cells(sweep, Path(TINY))
    cells, streams = sweep_runner.prepare_cells(_sweep(tmp_path), Path(TINY))
    assert [n for n, _ in cells] == list(streams) and len(cells) == 1
