"""A sweep's shared caches kept with its results (``hamo_ray/sweep/shared.py``): a cell on a fresh machine
reads the experts and the stage 0 a cell exported before it used; a kept entry wins over a different
local one and is never overwritten; locks and temporaries stay local; a broken kept file stops the sweep
with its name; without ``results`` nothing is kept. Through the real CLI for the start-up."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hamo_ray.config import ConfigError
from hamo_ray.envs.expert_cache import read_entry
from hamo_ray.sweep import load_sweep, restore_shared, save_shared
from hamo_ray.types import TaskSpec, Trajectory

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "jobs" / "configs" / "tiny.yaml"


def _sweep(tmp_path: Path, root: str = "root", results: str | None = "results", **extra):
    f = tmp_path / "sweep.yaml"
    lines = [f"base: {TINY}", f"root: {tmp_path / root}", "grid: {method: [hamo], seed: [0]}"]
    lines += [f"results: {tmp_path / results}"] if results else []
    lines += [f"{k}: {json.dumps(v)}" for k, v in extra.items()]
    f.write_text("\n".join(lines) + "\n")
    return load_sweep(f)[0]


def _expert_entry(route: str) -> bytes:
    task = TaskSpec(domain="scienceworld", task="boil", variation=3)
    traj = Trajectory(task=task, goal="boil water", init_obs="hallway", actions=[f"go to {route}"],
                      observations=["ok"], score=100.0, done=True, source="expert")  # fmt: skip
    return (traj.model_dump_json() + "\n").encode()


def _fill(root: Path) -> None:
    (root / "experts").mkdir(parents=True)
    (root / "experts" / "scienceworld-abc.jsonl").write_bytes(_expert_entry("kitchen"))
    (root / "experts" / "scienceworld-abc.jsonl.lock").write_text("")
    entry = root / "initial" / "stage0-key1"
    (entry / "episodes").mkdir(parents=True)
    (entry / "result.json").write_text('{"scores": {"scienceworld": 6.8}}')
    (entry / "episodes" / "stage-0-scienceworld.jsonl").write_text('{"x": 1}\n')
    (root / "initial" / ".stage0-key2.tmp-99").mkdir()  # an evaluation in progress elsewhere
    (root / "initial" / ".stage0-key2.tmp-99" / "result.json").write_text("{}")


def test_a_fresh_machine_reads_what_an_earlier_machine_kept(tmp_path):
    sweep = _sweep(tmp_path)
    _fill(tmp_path / "root")
    written = save_shared(sweep)
    kept = tmp_path / "results" / "shared"
    assert sorted(p.relative_to(kept).as_posix() for p in written) == [
        "experts/scienceworld-abc.jsonl.gz",
        "initial/stage0-key1/episodes/stage-0-scienceworld.jsonl.gz",
        "initial/stage0-key1/result.json.gz",
    ]  # no lock, no temporary
    assert save_shared(sweep) == []  # kept once
    # A fresh machine: the run root is gone with its caches.
    fresh = _sweep(tmp_path, root="fresh")
    restored = restore_shared(fresh)
    assert len(restored) == 3
    for rel in ("experts/scienceworld-abc.jsonl", "initial/stage0-key1/result.json"):
        assert (tmp_path / "fresh" / rel).read_bytes() == (tmp_path / "root" / rel).read_bytes()
    (traj,) = read_entry(tmp_path / "fresh" / "experts" / "scienceworld-abc.jsonl")  # the cache reads it
    assert traj.actions == ["go to kitchen"]
    assert restore_shared(fresh) == []  # nothing differs now


def test_a_kept_entry_wins_over_a_different_local_one_and_is_never_overwritten(tmp_path, caplog):
    sweep = _sweep(tmp_path)
    _fill(tmp_path / "root")
    save_shared(sweep)
    local = tmp_path / "root" / "experts" / "scienceworld-abc.jsonl"
    local.write_bytes(_expert_entry("greenhouse"))  # another replay of the expert on this machine
    assert save_shared(sweep) == []
    kept = tmp_path / "results" / "shared" / "experts" / "scienceworld-abc.jsonl.gz"
    assert b"kitchen" in gzip.decompress(kept.read_bytes())
    with caplog.at_level("WARNING"):
        assert restore_shared(sweep) == [local]
    assert b"kitchen" in local.read_bytes() and str(local) in caplog.text


def test_the_same_entry_gzips_to_the_same_bytes(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name / "experts").mkdir(parents=True)
        (tmp_path / name / "experts" / "e.jsonl").write_bytes(_expert_entry("kitchen"))
        save_shared(_sweep(tmp_path, root=name, results=f"results-{name}"))
    a, b = (tmp_path / f"results-{n}" / "shared" / "experts" / "e.jsonl.gz" for n in "ab")
    assert a.read_bytes() == b.read_bytes()  # no time stamp: no git change on another machine


def test_without_results_or_sharing_nothing_is_kept(tmp_path):
    _fill(tmp_path / "root")
    assert save_shared(_sweep(tmp_path, results=None)) == []
    off = _sweep(tmp_path, share_experts=False, share_initial=False)
    assert save_shared(off) == [] and not (tmp_path / "results").exists()
    only_experts = _sweep(tmp_path, share_initial=False)
    assert [p.name for p in save_shared(only_experts)] == ["scienceworld-abc.jsonl.gz"]


def test_a_broken_kept_file_stops_the_sweep_naming_it(tmp_path):
    sweep = _sweep(tmp_path)
    bad = tmp_path / "results" / "shared" / "experts" / "scienceworld-abc.jsonl.gz"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not gzip")
    with pytest.raises(ValueError, match=str(bad)):
        restore_shared(sweep)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "sweep.py"), "--config", str(tmp_path / "sweep.yaml")],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and str(bad) in proc.stderr and "cannot be read" in proc.stderr
    assert not (tmp_path / "root" / "experts").exists()  # nothing restored, no cell started


def test_two_sweeps_over_one_root_keep_and_restore_one_folder(tmp_path):
    """The flat methods' sweep names the trained sweep's kept caches (``shared:``): on a new machine it
    restores the experts the trained cells used, and what it adds lands in the same folder."""
    kept = tmp_path / "trained" / "shared"
    trained = _sweep(tmp_path, results="trained")
    _fill(tmp_path / "root")
    save_shared(trained)
    flat = _sweep(tmp_path, root="new-root", results="flat", shared=str(kept))
    restored = restore_shared(flat)
    assert sorted(p.relative_to(tmp_path / "new-root").as_posix() for p in restored) == [
        "experts/scienceworld-abc.jsonl",
        "initial/stage0-key1/episodes/stage-0-scienceworld.jsonl",
        "initial/stage0-key1/result.json",
    ]
    assert read_entry(tmp_path / "new-root" / "experts" / "scienceworld-abc.jsonl")[0].actions == [
        "go to kitchen"
    ]
    (tmp_path / "new-root" / "initial" / "stage0-key3").mkdir()
    (tmp_path / "new-root" / "initial" / "stage0-key3" / "result.json").write_text("{}")
    assert [p.relative_to(kept).as_posix() for p in save_shared(flat)] == [
        "initial/stage0-key3/result.json.gz"
    ]
    assert not (tmp_path / "flat" / "shared").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"results": None}, "needs results"),
        ({"shared": "root"}, "is the sweep's root"),
        ({"shared": "a-file"}, "is not a folder"),
    ],
)
def test_a_bad_shared_folder_is_named(tmp_path, monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    extra = {"shared": "kept", **extra}
    results = extra.pop("results", "results")
    with pytest.raises(ConfigError, match=rf"shared: .*{message}"):
        _sweep(tmp_path, results=results, **extra)
