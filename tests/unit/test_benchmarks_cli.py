"""The benchmarks' command lines: JSON results beside the printed table, one convention for list arguments.

Runs ``bench_selection.py`` and ``bench_retrieval.py`` at their smallest sizes as subprocesses (as a
user runs them, from the repository root) and checks that the JSON rows hold the numbers the table
printed, the arguments and the machine; checks that every ``benchmarks/bench_*.py`` answers
``--help`` and takes list arguments space-separated (``nargs``), never comma-separated. No Ray.

    bash scripts/test.sh tests/unit/test_benchmarks_cli.py -q
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = ROOT / "benchmarks"
SCRIPTS = sorted(BENCH_DIR.glob("bench_*.py"))
KNOWN = {
    "bench_distill",
    "bench_retrieval",
    "bench_rollout",
    "bench_selection",
    "bench_serving",
    "bench_train",
}


def _run(script: str, *args: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, f"{script} {' '.join(args)} exited {out.returncode}:\n{out.stderr[-3000:]}"
    return out.stdout.splitlines()


def _table_rows(lines: list[str]) -> list[list[str]]:
    """Cells of the rows printed between the dashed rule under the header and the ``results:`` line."""
    start = next(i for i, line in enumerate(lines) if line and set(line) == {"-"}) + 1
    end = next(i for i, line in enumerate(lines) if line.startswith("results: "))
    return [[c.strip() for c in line.split("|")] for line in lines[start:end]]


def _check_envelope(data: dict, name: str, args: dict, path: Path, lines: list[str]) -> None:
    assert data["benchmark"] == name
    assert data["args"] == args
    assert data["finished"] is True
    assert data["seconds"] > 0
    assert datetime.fromisoformat(data["started_at"]).tzinfo is not None
    machine = data["machine"]
    assert machine["cpu_count"] >= 1 and machine["python"] == ".".join(map(str, sys.version_info[:3]))
    assert "numpy" in machine["packages"] and machine["platform"]
    assert lines[-1] == f"results: {path}"


def test_selection_json_matches_table(tmp_path):
    path = tmp_path / "sel" / "x.json"  # a folder that does not exist yet
    lines = _run("bench_selection.py", "--sizes", "200", "300", "--max-steps", "20", "--json", str(path))
    data = json.loads(path.read_text())
    args = {"sizes": [200, 300], "max_blocks": 6, "max_steps": 20, "json": str(path)}
    _check_envelope(data, "bench_selection", args, path, lines)
    table = _table_rows(lines)
    assert len(table) == len(data["rows"]) == 2
    for cells, row in zip(table, data["rows"]):
        assert int(cells[0]) == row["cards"]
        assert cells[1].split() == [f"{row[k]:.2f}" for k in ("ours_s", "ours_neighbours_s", "ours_greedy_s")]
        # 20 greedy steps of ~65-100: the baseline is timed on a prefix and extrapolated, marked "~"
        assert row["plain_extrapolated"] is True and cells[2].startswith("~")
        plain = ("plain_s", "plain_neighbours_s", "plain_greedy_s")
        assert cells[2][1:].split() == [f"{row[k]:.1f}" for k in plain]
        assert cells[3] == f"{row['ratio']:.1f}x"
        assert math.isclose(row["ratio"], row["plain_s"] / row["ours_s"], rel_tol=1e-9)
        assert cells[4] == "True" and row["same_picks_and_gains"] is True
        assert int(cells[5]) == row["neighbour_rows_differing"]
        assert row["checked_steps"] == 20 < row["steps"]
        assert cells[6] == f"{row['checked_rows']}/{row['cards']} rows, 20/{row['steps']} steps"
        assert int(cells[7]) == row["budget"] > 0


def test_retrieval_json_matches_table(tmp_path):
    path = tmp_path / "ret.json"
    lines = _run(
        "bench_retrieval.py", "--sizes", "200", "--queries", "10", "--nprobes", "4", "8", "--json", str(path)
    )
    data = json.loads(path.read_text())
    args = {
        "sizes": [200],
        "dim": 384,
        "queries": 10,
        "nprobes": [4, 8],
        "refine": 10,
        "index_types": ["ivf_sq"],
        "json": str(path),
    }
    _check_envelope(data, "bench_retrieval", args, path, lines)
    table = _table_rows(lines)
    assert [r["nprobes"] for r in data["rows"]] == [4, 8] and len(table) == 2
    for cells, row in zip(table, data["rows"]):
        assert [int(cells[0]), cells[1], int(cells[2])] == [row["cards"], row["index"], row["nprobes"]]
        assert cells[3].split() == [f"{row['write_s']:.1f}", f"{row['index_s']:.1f}"]
        assert cells[4].split() == [f"{row['lance_p50_ms']:.2f}", f"{row['lance_p99_ms']:.2f}"]
        assert cells[5].split() == [f"{row['numpy_p50_ms']:.2f}", f"{row['numpy_p99_ms']:.2f}"]
        assert cells[6] == f"{row['p50_ratio']:.2f}x"
        assert math.isclose(row["p50_ratio"], row["numpy_p50_ms"] / row["lance_p50_ms"], rel_tol=1e-9)
        assert cells[7] == f"{row['recall_at_3']:.3f}" and 0 <= row["recall_at_3"] <= 1


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _parser_of(script: Path, monkeypatch) -> argparse.ArgumentParser:
    """The script's argument parser, caught at its ``parse_args`` call (its main builds it first)."""
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    spec = importlib.util.spec_from_file_location(f"_cli_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def catch(self, *args, **kwargs):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    monkeypatch.setattr(sys, "argv", [str(script)])
    with pytest.raises(_Parsed) as caught:
        module.main()
    monkeypatch.undo()
    return caught.value.parser


def test_every_benchmark_is_listed():
    assert {s.stem for s in SCRIPTS} >= KNOWN  # the glob below found them all


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_help_and_space_separated_lists(script, monkeypatch):
    help_text = "\n".join(_run(script.name, "--help"))
    assert "--json" in help_text
    parser = _parser_of(script, monkeypatch)
    lists = 0
    for action in parser._actions:
        if action.type is not None and callable(action.type):
            try:  # a comma-splitting type (the old --levels) turns "1,2" into a list
                value = action.type("1,2")
            except (ValueError, TypeError, argparse.ArgumentTypeError):
                value = None
            assert not isinstance(value, (list, tuple)), (
                f"{script.name} {action.option_strings} splits commas"
            )
        if isinstance(action.default, (list, tuple)):
            lists += 1
            opt = action.option_strings[0]
            assert action.nargs in ("+", "*"), f"{script.name} {opt}: a list argument needs nargs='+'"
            if action.default:  # the default, typed back space-separated, parses to itself
                parsed = parser.parse_args([opt, *map(str, action.default)])
                assert getattr(parsed, action.dest) == list(action.default)
    if script.stem in ("bench_selection", "bench_retrieval", "bench_serving", "bench_rollout"):
        assert lists >= 1  # the check above ran on their list arguments
    # one place for results: common.add_json_argument's default
    json_action = next(a for a in parser._actions if "--json" in a.option_strings)
    assert json_action.default == BENCH_DIR / "results" / f"{script.stem}.json"


def test_results_file_is_written_per_row_and_fails_early(tmp_path):
    sys.path.insert(0, str(BENCH_DIR))
    try:
        import numpy as np
        from common import Results
    finally:
        sys.path.remove(str(BENCH_DIR))
    args = argparse.Namespace(sizes=[1, 2], json=tmp_path / "r.json", model=None)
    results = Results("benchmarks/bench_fake.py", args)
    first = json.loads((tmp_path / "r.json").read_text())
    assert first["rows"] == [] and first["finished"] is False and first["benchmark"] == "bench_fake"
    results.add({"n": np.int64(3), "t": np.float32(0.5), "ratio": float("inf"), "ok": np.bool_(True)})
    partial = json.loads((tmp_path / "r.json").read_text())  # a run that dies here keeps this row
    assert partial["rows"] == [{"n": 3, "t": 0.5, "ratio": None, "ok": True}] and not partial["finished"]
    assert partial["args"] == {"sizes": [1, 2], "json": str(tmp_path / "r.json"), "model": None}
    assert results.finish() == tmp_path / "r.json"
    assert json.loads((tmp_path / "r.json").read_text())["finished"] is True
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left behind
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):  # an unwritable path fails before the benchmark runs
        Results("bench_fake.py", argparse.Namespace(json=tmp_path / "file" / "r.json"))
