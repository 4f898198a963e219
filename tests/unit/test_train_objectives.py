"""The objective registry (hamo_ray/training/objectives.py): a registered loss is what the loop trains on,
on the worker both engines run; an unknown objective is refused by name, on the driver and on a worker.

pytest tests/unit/test_train_objectives.py -q
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from hamo_ray.config import TrainConfig
from hamo_ray.training import objectives
from hamo_ray.training.examples import Example
from hamo_ray.training.trainer import stage_job

TARGETS = ["q_proj", "v_proj"]


def _examples(n: int = 6) -> list[Example]:
    rng = random.Random(0)
    rows = []
    for i in range(n):
        ids = [rng.randrange(3, 200) for _ in range(rng.randint(16, 40))]
        rows.append(Example(ids, [-100] * (len(ids) - 4) + ids[-4:], f"t{i}"))
    return rows


def test_the_built_in_objectives_are_registered():
    assert objectives.objective("bc") is objectives.behavioural_cloning
    assert objectives.objective("dpo") is objectives.dpo
    with pytest.raises(ValueError, match="'bc' is taken"):
        objectives.register("bc")(objectives.dpo)


def test_an_unknown_objective_is_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown training objective 'nope' \(registered: bc, dpo"):
        objectives.objective("nope")
    rows = _examples(2)
    with pytest.raises(
        ValueError, match="unknown training objective 'nope'"
    ):  # on the driver, before any worker
        stage_job(TrainConfig(), "base", rows, "out", [e.tokens for e in rows], objective="nope")


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    from hamo_ray.backbones.tiny_lm import make_random_backbone

    return str(make_random_backbone(tmp_path_factory.mktemp("objectives") / "base"))


@pytest.fixture
def worker(monkeypatch):
    """A rank-0-of-1 ``TrainWorker`` in this process (no Ray, no process group), as both engines run it."""
    import torch

    from hamo_ray.training.worker import TrainWorker

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # the worker sets them; restored after the test
        monkeypatch.setenv(key, "0")
    return TrainWorker(0, 1, use_gpu=False, threads=torch.get_num_threads())


def test_a_registered_objective_is_the_loss_both_engines_train_on(monkeypatch, backbone, worker):
    """A new objective is one registered function; the loop calls it once per stage and steps on its loss."""
    from hamo_ray.training.ray_train import RayTrainWorker
    from hamo_ray.training.worker import TrainWorker

    calls = {"stage": 0, "batches": 0}

    def constant(lm, rows, job, device):
        calls["stage"] += 1
        assert job.options == {"level": 1.5}
        bc = objectives.behavioural_cloning(lm, rows, job, device)

        def loss(model, batch_rows, idx):
            calls["batches"] += 1
            out = bc(model, batch_rows, idx)  # the graph through the model, its value replaced
            value = out.value * 0.0 + job.options["level"]
            return replace(out, value=value, correct=len(idx), counted=2 * len(idx))

        return loss

    monkeypatch.setitem(objectives.OBJECTIVES, "constant", constant)
    rows = _examples()
    tcfg = TrainConfig(lora_r=8, lora_alpha=16, target_modules=TARGETS, epochs=2, batch_size=2)
    job = stage_job(
        tcfg, backbone, rows, "unused", [e.tokens for e in rows], objective="constant", options={"level": 1.5}
    )
    out = worker.run(job)
    assert calls["stage"] == 1 and calls["batches"] == out.result.steps > 0
    assert out.result.losses == pytest.approx([1.5, 1.5])  # the objective's loss is what was recorded
    assert out.result.accuracy == pytest.approx([0.5, 0.5])  # and its counts, per epoch
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(out.files)
    # The Ray Train engine's worker runs the same method (the actor engine's worker is TrainWorker itself).
    assert RayTrainWorker.run is TrainWorker.run


def test_an_unknown_objective_reaching_a_worker_is_refused_by_name(backbone, worker):
    rows = _examples(2)
    job = replace(
        stage_job(TrainConfig(), backbone, rows, "unused", [e.tokens for e in rows]), objective="gone"
    )
    with pytest.raises(ValueError, match="unknown training objective 'gone'"):
        worker.run(job)
