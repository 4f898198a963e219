"""Test helpers: play expert episodes in the real environments and write them as AgentGym / ETO items.

The item layouts follow the public data: AgentGym's AgentTraj (``item_id`` ``<env>_<N>``, an agent prompt
answered ``Ok.``, replies ``Thought:\\n...\\n\\nAction:\\n...``, ScienceWorld's first turn = task
description + newline + ``look around`` text, ALFWorld's turns ending in ``AVAILABLE ACTIONS: ...``) and
ETO's SFT data (``id`` / ``game_file``, replies ``Thought: ...\\nAction: ...``, observations prefixed
``Observation:``, ScienceWorld's first turn = the task only, the episode opening with ``look around``).
"""

from __future__ import annotations

import json
from pathlib import Path

from hamo_ray.types import TaskSpec

AGENTGYM_PROMPT = {
    "from": "human",
    "loss": None,
    "value": "You are an agent ... Your response should use ...",
}
AGENTGYM_ACK = {"from": "gpt", "loss": False, "value": "Ok."}
ETO_PROMPT = {"from": "human", "value": "Interact with a household to solve a task. ..."}
ETO_ACK = {"from": "gpt", "value": "OK"}


def play(
    env, task: TaskSpec, actions: list[str] | None = None
) -> tuple[str, str, list[str], list[str], float]:
    """Reset ``task`` and step ``actions`` (default: the env's expert plan) until done.

    Returns:
        (goal, initial observation, actions taken, observations, final score).
    """
    goal, obs = env.reset(task)
    plan = env.expert_actions() if actions is None else actions
    taken, observations, score = [], [], 0.0
    for action in plan:
        result = env.step(action)
        taken.append(action)
        observations.append(result.observation)
        score = result.score
        if result.done:
            break
    return goal, obs, taken, observations, score


def agentgym_item(item_id: str, first: str, actions: list[str], observations: list[str], **extra) -> dict:
    conv = [AGENTGYM_PROMPT, AGENTGYM_ACK, {"from": "human", "loss": None, "value": first}]
    for k, (action, obs) in enumerate(zip(actions, observations, strict=True)):
        conv.append(
            {"from": "gpt", "loss": True, "value": f"Thought:\nstep {k} of the plan.\n\nAction:\n{action}"}
        )
        conv.append({"from": "human", "loss": None, "value": obs})
    return {"item_id": item_id, "conversations": conv, **extra}


def eto_item(
    ident: str | int | None, first: str, actions: list[str], observations: list[str], **extra
) -> dict:
    conv = [ETO_PROMPT, ETO_ACK, {"from": "human", "value": first}]
    for k, (action, obs) in enumerate(zip(actions, observations, strict=True)):
        conv.append({"from": "gpt", "value": f"Thought: step {k} of the plan.\nAction: {action}"})
        conv.append({"from": "human", "value": f"Observation: {obs}"})
    item = {"conversations": conv, **extra}
    if ident is not None:
        item["id"] = ident
    return item


def write(path: Path, items: list[dict]) -> Path:
    path.write_text(json.dumps(items, indent=1))
    return path
