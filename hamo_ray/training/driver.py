"""The stream's side of training: a stage's trajectories (and their cards) in, a trained adapter out.

:class:`StageTrainer` tokenises with the backbone's tokenizer, in the run's prompt and example format,
and trains on the stream's kept engine (``group.KeptGroup``) through ``trainer.train_model`` and
``dpo.train_dpo``, the run's ``TrainConfig`` passed whole::

    trainer = StageTrainer(cfg, model_path, KeptGroup(cfg.train))
    result = trainer.bc(batch, cards, out_dir, init_adapter=prev, seed=s, name="stage-1")
    encoded = trainer.encode_pairs(build_pairs(expert, explored))
    result = trainer.dpo(encoded, bc_dir, out_dir, seed=s, name="stage-1-dpo")

The stage's steps (``hamo_ray.run.stage``) train through these three methods only; the stage test puts a
fake in its place.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from hamo_ray.config import HamoConfig
from hamo_ray.training.contracts import EncodedPair, TrainResult
from hamo_ray.training.group import KeptGroup
from hamo_ray.types import Card, Trajectory

logger = logging.getLogger(__name__)


class StageTrainer:
    """Behavioural cloning and DPO of a stream's stages on its kept group.

    Args:
        cfg: the run's config (``train``, ``prompt``, ``model``'s template variables).
        model_path: the backbone (an HF folder): its tokenizer and the frozen base of every adapter.
        group: the stream's kept worker group.
    """

    def __init__(self, cfg: HamoConfig, model_path: str, group: KeptGroup) -> None:
        self.cfg, self.model_path, self.group = cfg, model_path, group

    @cached_property
    def tokenizer(self) -> Any:
        """The backbone's tokenizer, rendering with ``model.chat_template`` when set (as the server does)."""
        from transformers import AutoTokenizer

        from hamo_ray.chat import set_chat_template

        return set_chat_template(
            AutoTokenizer.from_pretrained(self.model_path), self.cfg.model.template_text()
        )

    def bc(
        self,
        batch: Sequence[Trajectory],
        cards: dict[str, list[Card]],
        out_dir: Path,
        *,
        init_adapter: Path | None,
        seed: int,
        name: str,
    ) -> TrainResult:
        """Experience-conditioned behavioural cloning on ``batch``, ``cards[trajectory id]`` injected."""
        from hamo_ray.training.examples import build_examples, example_options
        from hamo_ray.training.trainer import train_model

        cfg, tok = self.cfg, self.tokenizer
        examples = build_examples(
            list(batch), cards, tok, cfg.prompt, cfg.train.max_seq_len, cfg.model.template_kwargs(),
            **example_options(cfg),
        )  # fmt: skip
        logger.info(
            "train: %d trajectories -> %d %s examples, %d tokens (init from %s)", len(batch), len(examples),
            cfg.train.example_format, sum(len(e.input_ids) for e in examples), init_adapter,
        )  # fmt: skip
        return train_model(
            self.model_path, examples, out_dir, cfg.train, pad_id=tok.pad_token_id,
            init_adapter=str(init_adapter) if init_adapter else None, seed=seed, name=name, group=self.group.get(),
        )  # fmt: skip

    def encode_pairs(self, pairs: list[tuple[Trajectory, Trajectory]]) -> list[EncodedPair]:
        """(chosen, rejected) trajectory pairs tokenised as training examples (``dpo.encode_pairs``)."""
        from hamo_ray.training.dpo import encode_pairs
        from hamo_ray.training.examples import example_options

        cfg = self.cfg
        return encode_pairs(
            pairs, self.tokenizer, cfg.prompt, cfg.train.max_seq_len, cfg.model.template_kwargs(),
            **example_options(cfg),
        )  # fmt: skip

    def dpo(
        self, pairs: list[EncodedPair], init_adapter: Path, out_dir: Path, *, seed: int, name: str
    ) -> TrainResult:
        """DPO on ``pairs``, from (and referenced to) the behavioural-cloning adapter ``init_adapter``."""
        from hamo_ray.training.dpo import train_dpo

        return train_dpo(
            self.model_path, str(init_adapter), pairs, out_dir, self.cfg.train,
            pad_id=self.tokenizer.pad_token_id, seed=seed, name=name, group=self.group.get(),
        )  # fmt: skip
