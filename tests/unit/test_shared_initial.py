"""Stage 0 shared by the runs it is the same for (``eval.initial_cache``, hamo_ray/run/initial.py).

The key ignores what cannot act at stage 0 (the method, training, selection, replay, memory, the run's
id) and follows everything else (the seed, the model, the test tasks, the prompt, the rollout); a
second run with the same key copies the first one's result and episodes and never plays; a broken
entry is played again and replaced; a memory holding cards, with retrieval on, is never shared;
parallel runs play once. No Ray: ``evaluate`` stands for the stage's evaluation (the real one runs in
tests/ray/test_sweep.py, marked slow, and in the powered sweep, docs/results.md)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from hamo_ray.config import load_config
from hamo_ray.run.folder import RunFolder
from hamo_ray.run.initial import initial_key, key_material, shared_initial
from hamo_ray.sweep import expand_cells, load_sweep
from hamo_ray.types import StageResult, TaskSpec, Trajectory

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "jobs" / "configs" / "tiny.yaml"
TESTS = {
    "scienceworld": [TaskSpec(domain="scienceworld", task="boil", variation=v, split="test") for v in (1, 5)]
}


def _cfg(tmp_path: Path, *over: str):
    return load_config(TINY, [f"eval.initial_cache={tmp_path / 'initial'}", *over])


def _folder(tmp_path: Path, cfg, name: str) -> RunFolder:
    folder = RunFolder(tmp_path / "cells" / name, cfg)
    folder.path.mkdir(parents=True)
    return folder


def _player(folder: RunFolder, calls: list, route: str = "kitchen", score: float = 25.0):
    """An evaluation that saves its episodes into ``folder`` as the real one does."""

    def play():
        calls.append(folder.path.name)
        trajs = [
            Trajectory(task=t, goal="boil water", init_obs="hallway", actions=[f"go to {route}"],
                       observations=["ok"], score=score, done=False, source="policy")
            for t in TESTS["scienceworld"]
        ]  # fmt: skip
        folder.save_episodes(0, "scienceworld", trajs)
        stats = {"episodes": 2.0, "failed_episodes": 0.0, "seconds_per_episode": 11.0}
        return ({"scienceworld": score}, stats), {"evaluate": 22.0}

    return play


def test_the_methods_of_a_seed_share_one_key_and_the_rest_of_the_config_splits_it(tmp_path):
    key = initial_key(_cfg(tmp_path), TESTS)
    same = ["method.name=model_only", "method.name=agenttuning", "method.name=harness", "train.epochs=7",
            "memory.top_k=5", "selection.k=2", "run.id=another", f"run.root={tmp_path / 'x'}",
            f"eval.initial_cache={tmp_path / 'elsewhere'}"]  # fmt: skip
    for over in same:
        assert initial_key(_cfg(tmp_path, over), TESTS) == key, over
    differ = ["run.seed=1", "env.max_turns=4", "prompt.history_turns=3", "rollout.temperature=0.3",
              "protocol.test_per_task=3", "rollout.max_tokens=17", "model.path=smollm2-135m-instruct"]  # fmt: skip
    for over in differ:
        assert initial_key(_cfg(tmp_path, over), TESTS) != key, over
    other_tests = {"scienceworld": TESTS["scienceworld"][::-1]}
    assert initial_key(_cfg(tmp_path), other_tests) != key
    material = key_material(_cfg(tmp_path, "serve.api_key=sk-secret-1"), TESTS)
    assert "sk-secret-1" not in json.dumps(material)  # a secret never lands in the cache's key.json
    assert "method" not in material["config"] and "id" not in material["config"]["run"]


def test_a_second_run_copies_the_first_runs_stage_0_and_never_plays(tmp_path):
    calls: list = []
    first_cfg = _cfg(tmp_path, "method.name=model_only")
    first = _folder(tmp_path, first_cfg, "model_only-s0")
    played = shared_initial(first_cfg, first, TESTS, _player(first, calls))
    assert calls == ["model_only-s0"] and played.initial_from is None and played.seconds == {"evaluate": 22.0}

    second_cfg = _cfg(tmp_path, "method.name=hamo")
    second = _folder(tmp_path, second_cfg, "hamo-s0")
    copied = shared_initial(second_cfg, second, TESTS, _player(second, calls, route="garden", score=99.0))
    assert calls == ["model_only-s0"]  # the garden evaluation never ran
    assert copied.method == "hamo" and copied.initial_from == "model_only-s0"
    assert copied.scores == played.scores == {"scienceworld": 25.0}
    assert copied.evaluation == played.evaluation and copied.seconds["evaluate"] < 5
    episodes = "episodes/stage-0-scienceworld.jsonl"
    assert (second.path / episodes).read_text() == (first.path / episodes).read_text()
    assert StageResult.model_validate_json(copied.model_dump_json()) == copied  # what state.json holds
    (entry,) = [p for p in (tmp_path / "initial").glob("stage0-*") if p.is_dir()]
    assert json.loads((entry / "key.json").read_text()) == key_material(first_cfg, TESTS)


def test_another_seed_plays_its_own_stage_0(tmp_path):
    calls: list = []
    for seed in (0, 1):
        cfg = _cfg(tmp_path, f"run.seed={seed}")
        folder = _folder(tmp_path, cfg, f"hamo-s{seed}")
        assert shared_initial(cfg, folder, TESTS, _player(folder, calls)).initial_from is None
    assert calls == ["hamo-s0", "hamo-s1"]


def test_a_broken_entry_is_played_again_and_replaced(tmp_path, caplog):
    calls: list = []
    cfg = _cfg(tmp_path)
    first = _folder(tmp_path, cfg, "a")
    shared_initial(cfg, first, TESTS, _player(first, calls))
    (entry,) = [p for p in (tmp_path / "initial").glob("stage0-*") if p.is_dir()]
    (entry / "episodes" / "stage-0-scienceworld.jsonl").write_text('{"truncated": ')
    second = _folder(tmp_path, cfg, "b")
    with caplog.at_level("WARNING"):
        result = shared_initial(cfg, second, TESTS, _player(second, calls, score=50.0))
    assert calls == ["a", "b"] and result.initial_from is None and result.scores == {"scienceworld": 50.0}
    assert str(entry) in caplog.text and "cannot be read" in caplog.text
    third = _folder(tmp_path, cfg, "c")
    assert shared_initial(cfg, third, TESTS, _player(third, calls)).initial_from == "b"  # the replacement
    assert not list((tmp_path / "initial").glob(".*tmp*"))


def test_a_memory_holding_cards_with_retrieval_on_is_never_shared(tmp_path):
    calls: list = []
    for name in ("a", "b"):
        cfg = _cfg(tmp_path, "method.name=harness")
        folder = _folder(tmp_path, cfg, name)
        result = shared_initial(cfg, folder, TESTS, _player(folder, calls), cards_at_stage_0=lambda: 3)
        assert result.initial_from is None
    assert calls == ["a", "b"] and not (tmp_path / "initial").exists()
    # Without retrieval the cards are never asked for (and cannot act).
    cfg = _cfg(tmp_path, "method.name=model_only")
    folder = _folder(tmp_path, cfg, "c")
    shared_initial(cfg, folder, TESTS, _player(folder, calls), cards_at_stage_0=lambda: 1 / 0)
    assert calls == ["a", "b", "c"]


def test_without_the_cache_every_run_plays(tmp_path):
    calls: list = []
    for name in ("a", "b"):
        cfg = load_config(TINY, [])
        folder = _folder(tmp_path, cfg, name)
        assert shared_initial(cfg, folder, TESTS, _player(folder, calls)).initial_from is None
    assert calls == ["a", "b"]


def test_parallel_runs_with_one_key_play_once(tmp_path):
    calls: list = []
    results: dict = {}

    def run(name: str) -> None:
        cfg = _cfg(tmp_path)
        folder = _folder(tmp_path, cfg, name)
        play = _player(folder, calls)

        def slow_play():
            time.sleep(0.3)  # the other run asks for the entry meanwhile
            return play()

        results[name] = shared_initial(cfg, folder, TESTS, slow_play)

    threads = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert sorted(r.initial_from or "" for r in results.values()) == ["", calls[0]]


@pytest.mark.parametrize("share", [True, False])
def test_a_sweep_gives_its_cells_the_shared_folder(tmp_path, share):
    f = tmp_path / "sweep.yaml"
    f.write_text(
        f"base: {TINY}\nroot: {tmp_path / 'sweep'}\nshare_initial: {str(share).lower()}\n"
        "grid: {method: [hamo, model_only], seed: [0]}\n"
    )
    sweep, base = load_sweep(f)
    caches = {cfg.eval.initial_cache for _, cfg in expand_cells(sweep, base)}
    assert caches == ({str(tmp_path / "sweep" / "initial")} if share else {None})


def test_the_stream_commits_a_copied_stage_0_for_each_method_after_the_first(tmp_path, monkeypatch):
    """``initial_stage`` (what ``Stream`` calls) wired to the cache: the run's real (empty) LanceDB memory
    is counted for retrieval methods, the episodes land in each run folder, and ``state.json`` names the
    source."""
    from types import SimpleNamespace

    import hamo_ray.run.stage as stage_mod

    calls: list = []

    def evaluate_policy(ctx, stage, model):
        assert stage == 0 and model is None
        played, _ = _player(ctx.folder, calls)()
        return played

    monkeypatch.setattr(stage_mod, "evaluate_policy", evaluate_policy)
    for method in ("model_only", "hamo", "hamo_no_conditioning"):
        cfg = _cfg(tmp_path, f"method.name={method}")
        folder = _folder(tmp_path, cfg, f"{method}-s0")
        result = stage_mod.initial_stage(
            SimpleNamespace(cfg=cfg, folder=folder, tasks=SimpleNamespace(test=TESTS))
        )
        folder.commit(result)
        (saved,) = folder.stages()
        assert saved.method == method and saved.initial_from == (
            None if method == "model_only" else "model_only-s0"
        )
        assert (folder.path / "episodes" / "stage-0-scienceworld.jsonl").is_file()
    assert calls == ["model_only-s0"]
