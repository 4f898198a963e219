"""Training on one long-lived Ray Train run: stages on the same workers, a worker killed mid-stage survived.

pytest tests/ray/test_train_ray.py -q
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import pytest

from hamo_ray.config import TrainConfig
from hamo_ray.training.examples import Example
from hamo_ray.training.trainer import train_model

VOCAB = 200  # inside the random backbone's vocabulary (its tokenizer is trained on a few sentences)


def _examples(n: int, seed: int = 0, length: int = 160) -> list[Example]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        ids = [rng.randrange(3, VOCAB) for _ in range(length)]
        labels = [-100] * (length - 8) + ids[-8:]
        rows.append(Example(input_ids=ids, labels=labels, trajectory_id=f"t{i}"))
    return rows


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from transformers import AutoConfig

    from hamo_ray.backbones.tiny_lm import make_random_backbone

    path = make_random_backbone(tmp_path_factory.mktemp("rt") / "base")
    assert AutoConfig.from_pretrained(path).vocab_size > VOCAB
    return str(path)


def _adapter_files(folder) -> set[str]:
    return {p.name for p in folder.iterdir()}


def test_stages_share_one_run_and_a_killed_worker_is_retrained_once(ray_session, base, tmp_path):
    """Four stages on one Ray Train run. Stage 2 starts fast on the same workers (the model stays
    loaded); rank 1 is SIGKILLed during stage 3: Ray Train restarts the group, stage 3 is retrained from
    its start, exactly one adapter comes back, and stage 4 trains on the restarted group."""
    from hamo_ray.training.group import make_group

    tcfg = TrainConfig(
        num_workers=2,
        cpus_per_worker=0.5,
        batch_size=2,
        epochs=1,
        lr=1e-3,
        engine="ray_train",
        max_failures=1,
    )
    group = make_group(tcfg, name="test-rt", storage=tmp_path / "ray_train")
    killed: list[int] = []

    def kill_rank1_in_job(seq: int) -> None:
        deadline = time.time() + 300
        while time.time() < deadline:
            rows = [s for s in group.attempts() if s["seq"] == seq and s["rank"] == 1]
            if rows:  # the job is taken and not finished: kill now (a quiet machine trains it in seconds)
                os.kill(rows[0]["pid"], signal.SIGKILL)
                killed.append(rows[0]["pid"])
                return
            time.sleep(0.02)

    def stage(k: int, n: int, prev=None, epochs: int = 1):
        return train_model(base, _examples(n, k), tmp_path / f"s{k}", tcfg.model_copy(update={"epochs": epochs}),
                           pad_id=0, group=group, init_adapter=prev)  # fmt: skip

    try:
        r1 = stage(1, 8)
        r2 = stage(2, 8, r1.path)
        before_kill = group.attempts()
        killer = threading.Thread(target=kill_rank1_in_job, args=(2,))
        killer.start()
        r3 = stage(3, 96, r2.path, epochs=3)
        killer.join()
        r4 = stage(4, 8, r3.path)
        starts = group.attempts()
    finally:
        group.shutdown()
    # One run, stages chained, the second on the same loaded workers.
    assert r2.startup_s < 5.0, r2.startup_s
    assert sorted((s["seq"], s["rank"], s["attempt"]) for s in before_kill) == [
        (0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 1)
    ]  # fmt: skip
    # The kill: begun, killed, retrained from its start by a new group; the next stage on that group.
    assert killed, "the worker was never seen in stage 3"
    job3 = sorted((s["attempt"], s["rank"]) for s in starts if s["seq"] == 2)
    assert job3 == [(1, 0), (1, 1), (2, 0), (2, 1)], job3
    assert {s["attempt"] for s in starts if s["seq"] == 3} == {2}
    assert killed[0] not in {s["pid"] for s in starts if s["attempt"] == 2}
    for k, r in enumerate((r1, r2, r3, r4), start=1):
        assert r.path == str(tmp_path / f"s{k}") and r.steps > 0 and r.loss == r.loss
        assert {"adapter_config.json", "adapter_model.safetensors"} <= _adapter_files(tmp_path / f"s{k}")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("s")) == ["s1", "s2", "s3", "s4"]
    # Ray Train's own record: one run, the latest stage's adapter as its checkpoint.
    (run,) = (tmp_path / "ray_train").iterdir()
    assert run.name.startswith("test-rt-")
    ckpts = sorted(p.name for p in run.iterdir() if p.is_dir() and p.name.startswith("checkpoint_"))
    # num_to_keep=1 keeps the latest; the restarted group's manager keeps the first group's last too.
    assert ckpts[-1] == "checkpoint_job0003" and set(ckpts) <= {"checkpoint_job0001", "checkpoint_job0003"}, (
        ckpts
    )
    assert (run / ckpts[-1] / "adapter" / "adapter_config.json").exists()
    assert group.error is None


def test_failures_spent_raise_a_clear_error(ray_session, base, tmp_path):
    """With max_failures=0 the killed run ends: the waiting stage raises, naming the engine."""
    from hamo_ray.training.group import make_group
    from hamo_ray.training.ray_train import TrainingEngineError

    tcfg = TrainConfig(
        num_workers=1, cpus_per_worker=0.5, batch_size=2, epochs=3, engine="ray_train", max_failures=0
    )
    group = make_group(tcfg, name="test-spent", storage=tmp_path / "ray_train")

    def kill_first() -> None:
        for _ in range(15000):
            rows = group.attempts()
            if rows:  # the job is taken: kill before it can finish
                os.kill(rows[0]["pid"], signal.SIGKILL)
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_first)
    killer.start()
    try:
        with pytest.raises(TrainingEngineError, match="Ray Train run test-spent-"):
            train_model(base, _examples(24), tmp_path / "s1", tcfg, pad_id=0, group=group)
    finally:
        killer.join()
        group.shutdown()
    assert not (tmp_path / "s1").exists()


@pytest.mark.slow
def test_a_stream_survives_a_training_worker_killed_mid_stage(ray_session, tmp_path):
    """The tiny stream on Ray Train; rank 1 is SIGKILLed during stage 2's training. The stream still
    commits every stage, with one adapter per stage, as an unbroken run does."""
    from hamo_ray.config import load_config
    from hamo_ray.run.stream import Stream

    cfg = load_config(
        "jobs/configs/tiny.yaml",
        [
            "backbone.per_task=6", "backbone.epochs=2", "protocol.train_per_task=6", "protocol.test_per_task=2",
            "env.max_turns=6", "rollout.num_workers=2", "rollout.envs_per_worker=2", "train.epochs=3",
            "train.num_workers=2", "train.cpus_per_worker=0.5", "train.max_failures=1",
            "serve.port=18473", "serve.app_name=hamo-kill-test", f"run.root={tmp_path}", "run.id=k",
            f"backbone.cache_dir={tmp_path / 'backbones'}",
        ],
    )  # fmt: skip
    stream = Stream(cfg)
    killed: list[int] = []

    def kill_in_stage_2() -> None:
        deadline = time.time() + 1500
        while time.time() < deadline:
            group = getattr(stream.train_group, "group", None) if stream.train_group else None
            rows = [s for s in group.attempts() if s["seq"] == 1 and s["rank"] == 1] if group else []
            if rows:  # stage 2's job is taken and not finished
                os.kill(rows[0]["pid"], signal.SIGKILL)
                killed.append(rows[0]["pid"])
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_in_stage_2, daemon=True)
    killer.start()
    results = stream.run()
    killer.join(timeout=5)
    assert killed, "no training worker was seen in stage 2"
    assert [r.stage for r in results] == [1, 2] == list(range(1, cfg.protocol.num_stages + 1))
    adapters = sorted(p.name for p in (tmp_path / "k" / "adapters").iterdir() if p.is_dir())  # no .tmp left
    assert adapters == ["stage-1", "stage-2"], adapters
    state = json.loads((tmp_path / "k" / "state.json").read_text())
    assert [s["stage"] for s in state["stages"]] == [1, 2]


@pytest.mark.slow  # two worker-group starts and model loads (~1 min on 2 cores)
def test_a_stage_that_raises_names_the_job_rank_and_error(ray_session, base, tmp_path):
    """A bug, not a lost worker: retried max_failures times like any failure, then raised with the traceback."""
    from hamo_ray.training.group import make_group
    from hamo_ray.training.ray_train import TrainingEngineError

    tcfg = TrainConfig(
        num_workers=1, cpus_per_worker=0.5, batch_size=2, epochs=1, engine="ray_train", max_failures=1
    )
    group = make_group(tcfg, name="test-bug", storage=tmp_path / "ray_train")
    bad = [
        Example(input_ids=[10**6] * 12, labels=[10**6] * 12, trajectory_id="oov")
    ]  # outside the vocabulary
    try:
        with pytest.raises(
            TrainingEngineError, match=r"(?s)job 0 \(train bug\).*max_failures=1 spent.*attempt 2.*IndexError"
        ):
            train_model(base, bad, tmp_path / "s1", tcfg, pad_id=0, group=group, name="bug")
    finally:
        group.shutdown()
