"""Data contracts between the stages of a HaMo stream.

Every arrow of the stage data flow (collect -> distil -> select -> replay -> train -> publish ->
evaluate -> commit) carries one of these types, never an untyped dict. They are plain, frozen
pydantic models: cheap to pickle through Ray, easy to write as JSON lines, and validated on the way in.

The id and key formats are defined here and nowhere else: ``TaskSpec.id``
(``domain/task/split/variation``), :func:`trajectory_id` (``<task id>/<source>``), :func:`card_id`
(a hash of the trajectory id), :func:`key_text` (what is embedded for retrieval: goal and first
observation) and :func:`card_text` (what is embedded for coverage selection: the whole card).
"""

from __future__ import annotations

import hashlib

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TaskSpec(_Frozen):
    """One episode to run: a task of a domain, one of its variations, from one split."""

    domain: str
    task: str
    variation: int
    split: str = "train"

    @property
    def id(self) -> str:
        return f"{self.domain}/{self.task}/{self.split}/{self.variation}"


class Trajectory(_Frozen):
    """One episode: goal, initial observation, the (action, observation) turns and the final score.

    ``observations[k]`` is what the environment answered to ``actions[k]``. ``score`` is on 0-100.
    ``error`` is set (and ``score`` is 0) when the episode could not be run to the end.
    """

    task: TaskSpec
    goal: str
    init_obs: str
    actions: list[str] = Field(default_factory=list)
    observations: list[str] = Field(default_factory=list)
    # Optional reasoning before each action (ReAct "Thought: ..."), e.g. from imported expert data:
    # empty, or one entry per action ("" where a step has none).
    thoughts: list[str] = Field(default_factory=list)
    score: float = 0.0
    done: bool = False
    source: str = "policy"  # "expert" (gold actions) or "policy" (the served model)
    model: str | None = None  # the served model name that acted, for policy episodes
    cards_used: list[str] = Field(default_factory=list)  # ids of the injected experience cards
    # Cards the harness retrieved but did not inject: held back by the gate (``memory.gate_*``), and
    # dropped by ``fit_cards`` to keep the prompt within ``prompt_budget``.
    cards_withheld: int = 0
    cards_dropped: int = 0
    policy_tokens: int = 0  # completion tokens the policy generated in this episode
    error: str | None = None

    @model_validator(mode="after")
    def _check(self) -> Trajectory:
        if len(self.actions) != len(self.observations):
            raise ValueError(
                f"trajectory {self.task.id}: {len(self.actions)} actions but {len(self.observations)} observations"
            )
        if self.thoughts and len(self.thoughts) != len(self.actions):
            raise ValueError(
                f"trajectory {self.task.id}: {len(self.thoughts)} thoughts but {len(self.actions)} actions"
            )
        if not 0.0 <= self.score <= 100.0:
            raise ValueError(f"trajectory {self.task.id}: score {self.score} outside 0-100")
        return self

    @property
    def id(self) -> str:
        """Stable id: the task and the source (one expert trajectory per task variation)."""
        return trajectory_id(self.task, self.source)

    @property
    def card_id(self) -> str:
        """The id of the experience card distilled from this trajectory."""
        return card_id(self.id)

    @property
    def num_turns(self) -> int:
        return len(self.actions)


def trajectory_id(task: TaskSpec, source: str) -> str:
    """A trajectory's id: its task's and its source's (``expert`` or ``policy``)."""
    return f"{task.id}/{source}"


def card_id(trajectory_id: str) -> str:
    """Card ids derive from the trajectory, so a re-run never creates a second card for it."""
    return hashlib.sha1(trajectory_id.encode()).hexdigest()[:16]


def key_text(goal: str, init_obs: str) -> str:
    """The text embedded for a card and for a retrieval query: the goal, then the initial observation."""
    return f"{goal}\n{init_obs}"


def card_text(goal: str, init_obs: str, outline: str) -> str:
    """The text embedded for coverage selection (``selection.embed: card``): the whole card, so two
    cards are near when their strategies are, not only their start rooms (docs/method.md step 2).

    The goal, the outline, then the initial observation: the embedding model reads a bounded number of
    tokens (256 word pieces for the default), and a ScienceWorld start room alone runs to 230 of them,
    so the room comes last, where truncation cuts it and never the outline.
    """
    return f"{goal}\n{outline}\n{init_obs}"


class Card(_Frozen):
    """An experience card ``(goal, initial observation, outline)`` distilled from one trajectory.

    This is the row schema of the LanceDB ``cards`` table (plus the embeddings ``vector``, of the key,
    and ``card_vector``, of the whole card, whose width depends on the embedding model; added by
    ``hamo_ray.memory.schema``).
    """

    id: str
    trajectory_id: str
    domain: str
    task: str
    variation: int
    stage: int
    goal: str
    init_obs: str
    outline: str
    score: float

    @property
    def key_text(self) -> str:
        """The text that is embedded and matched at retrieval time: (goal, initial observation)."""
        return key_text(self.goal, self.init_obs)

    @property
    def card_text(self) -> str:
        """The text embedded for coverage selection: goal, outline and initial observation."""
        return card_text(self.goal, self.init_obs, self.outline)


class StageResult(_Frozen):
    """What one committed stage produced; ``state.json`` holds one per finished stage."""

    stage: int  # 1..T; 0 is the evaluation before any stage (protocol.eval_initial)
    method: str
    domain: str = ""  # the domain whose training data this stage used
    num_trajectories: int
    num_cards: int
    budget: int
    anchors: list[str]  # trajectory ids chosen by coverage selection (or all, without selection)
    replay: list[str]  # trajectory ids replayed from earlier stages
    adapter: str | None  # adapter folder, relative to the run folder; None when the method does not train
    adapter_name: str | None  # the name the serving endpoint knows it by
    train_loss: float | None
    scores: dict[str, float]  # domain -> mean score (0-100) on its test set
    seconds: dict[str, float]  # phase -> wall seconds
    # The evaluation's figures: episodes, seconds_per_episode, prefix_cache_hit_rate (vLLM's counters)
    evaluation: dict[str, float] = Field(default_factory=dict)
    # Step 6 (method.release; empty otherwise): replayed, released, replay_failed, replay_mean_score (the
    # anchors replayed with the new adapter and no cards), followup_checked, followup_solved (the previous
    # stage's released cards' tasks replayed again with this stage's adapter, and how many still solved).
    release: dict[str, float] = Field(default_factory=dict)
    # Step 2 (methods with memory): cards_added, rejected, llm_outlines, fallback_outlines (outlines the
    # LLM distiller failed to write, written by the deterministic one instead).
    distil: dict[str, float] = Field(default_factory=dict)
    released: list[str] = Field(default_factory=list)  # card ids this stage released (step 6)
    # Step 5 with method.conditioning: the cards the training examples carried: injected, withheld (by
    # the gate, memory.gate_*), same_world (cards of an example's own world, skipped). The cards of
    # evaluation are in ``evaluation`` (cards_injected, cards_withheld, cards_dropped).
    train_cards: dict[str, float] = Field(default_factory=dict)
    # Stage 0 only: the run whose stage-0 evaluation this is, when copied from ``eval.initial_cache``
    # (hamo_ray/run/initial.py: same config but for what cannot act at stage 0); None: played here.
    initial_from: str | None = None

    @classmethod
    def initial(
        cls, method: str, scores: dict[str, float], seconds: dict[str, float], evaluation: dict[str, float]
    ) -> StageResult:
        """Stage 0: the evaluation before any stage (no data, no adapter)."""
        return cls(
            stage=0, method=method, num_trajectories=0, num_cards=0, budget=0, anchors=[], replay=[],
            adapter=None, adapter_name=None, train_loss=None, scores=scores, seconds=seconds,
            evaluation=evaluation,
        )  # fmt: skip
