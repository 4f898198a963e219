"""Import expert trajectories from the public conversation formats: AgentGym's AgentTraj and ETO's SFT data.

Usage (a run does this itself with ``env.expert_source=file`` and ``env.expert_files={domain: path}``)::

    trajs = load_expert_file("data/sciworld_sft.json", "scienceworld", cfg.env)   # list[Trajectory]
    stage_trajs = stage_experts(cfg, stage=1)                                      # a stage's share

**Format.** A JSON list (or JSON lines) of items, each with an id and ``conversations``: a list of
``{"from": "human" | "gpt", "value": text}`` turns (``role``/``content`` with ``user``/``assistant`` is
read too). An opening instruction turn answered by a short acknowledgement (``OK`` / ``Ok.``) is the
dataset's own agent prompt and is dropped (the run uses its own prompt). The next human turn holds
the task and the first observation; then each gpt turn holds one action, as ``Thought: ...\\nAction:
...`` (AgentGym also writes ``Thought:\\n...\\n\\nAction:\\n...``) or as a plain action, and the human
turn after it the observation (an ``Observation:`` prefix is removed; a last action without an
answer gets the observation ``""``). Thoughts go to ``Trajectory.thoughts``.

**Item ids -> task ids** (``TaskSpec``); the split of a task is the split its variation belongs to:

=============  =================================================  ==============================================
domain         AgentGym (``item_id``)                             ETO (``id`` / ``game_file``)
=============  =================================================  ==============================================
scienceworld   ``sciworld_<N>``: N-th (task, variation) of the    ``<T>_<V>``: task T of ETO's taskname2id
               AgentGym server's list: the package's tasks in     (its 30 task names sorted alphabetically,
               id order without 5-x, 9-x, 10-x, each with all    ``expert_ids``), variation V
               its variations in order
alfworld       ``alfworld_<N>``: line N of AgentGym's mapping     ``game_file``: a path ending in
               (``data/agentgym_alfworld_games.txt``)            ``<split dir>/<task folder>/<trial>[/game...]``
webshop        ``webshop_<N>``: WebShop goal (session) N          ``id``: WebShop goal (session) N
=============  =================================================  ==============================================

ALFWorld games map to the domain's variation index (the game's place in its split's sorted game list:
official games; for generated games, the variation in the folder name), so the official data (or the
generated games, with ``env.alfworld.games=generated``) must be there. Games in AgentGym's
``valid_train`` folder belong to no split this project uses and are skipped (logged). WebShop items
need a real backend (``env.webshop.backend=text_env`` or ``http``): the stand-in's tasks are not
WebShop's goals.

**Normalisation** to what the environments here return: ScienceWorld's first turn is split into the
task sentence and the ``look around`` text (``This room is called ...``); where it holds only the task
(ETO), the expert's leading ``look around`` (which this project's ``reset`` already does) becomes the
initial observation. ALFWorld's first turn is split at ``Your task is to:``; an ``AVAILABLE ACTIONS:``
line (AgentGym) is removed; the put command, recorded as ``put O in/on R`` (the grammar of the data's
alfworld release), is written as the game's grammar has it (``move O to R`` in alfworld 0.4); the
recorded observations are kept as they are. WebShop's goal is the page's ``Instruction:`` text.
TextCraft (``textcraft_<N>``) and BabyAI (``babyai_<N>``) items map to the item N of their AgentGym
server (``hamo_ray.envs.agentgym.domains``) and split their first turn as the server's reset does
(the ``Goal:`` line; the ``Your goal:`` line).

**Score**: the item's ``reward`` (0-1, ETO's WebShop data) x 100, or its ``score`` (0-100); without
either the item counts as a success, 100 (expert data). Items scoring 0 are left out of training.

**A stage's experts** (``stage_experts``): the file's items of the stage's domain whose task lies in
the ``train`` split and whose task type is in ``env.task_types``, at most ``protocol.train_per_task``
per type (lowest variations first); cross-domain: all of them form the domain's stage; within-domain:
they are dealt round-robin over ``protocol.num_stages`` stages per task type, as the simulator's tasks
are. Items of dev/test tasks are never trained on (logged). Duplicate tasks keep their first item.
AgentGym items of other environments (AgentTraj-L mixes them in one file) are skipped (logged), so
one mixed file may serve as every domain's ``env.expert_files`` entry.

A malformed file raises ``ExpertDataError`` naming the file, the item index and the field.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from pathlib import Path
from typing import Any

from hamo_ray.config import ConfigError, EnvConfig, HamoConfig
from hamo_ray.envs.expert_ids import (
    AGENTGYM_PREFIX,
    ExpertDataError,
    Item,
    agentgym_server_task,
    alfworld_commands,
    alfworld_task,
    scienceworld_task,
    webshop_task,
)
from hamo_ray.types import Trajectory

__all__ = ["ExpertDataError", "load_expert_file", "split_react", "stage_experts", "train_experts_by_type"]

logger = logging.getLogger(__name__)

DOMAINS = ("scienceworld", "alfworld", "webshop", "textcraft", "babyai")
_ACK = {"ok", "okay", "ok!", "sure"}
_OBS_PREFIX = re.compile(r"^\s*observation:\s*", re.IGNORECASE)
_AVAILABLE = re.compile(r"\n?\s*AVAILABLE ACTIONS:.*\Z", re.DOTALL)
_ACTION = re.compile(r"(?:^|\n)\s*Action:\s*", re.IGNORECASE)
_THOUGHT = re.compile(r"^\s*Thought:\s*", re.IGNORECASE)
_INSTRUCTION = re.compile(r"Instruction:\s*\[SEP\]\s*(.*?)\s*\[SEP\]", re.DOTALL)


def split_react(text: str) -> tuple[str, str]:
    """``"Thought: t\\nAction: a"`` -> ``("t", "a")``; a reply without ``Action:`` is a plain action.

    The action is the first non-empty line after the last ``Action:``, whitespace normalised.
    """
    parts = _ACTION.split(text)
    thought = _THOUGHT.sub("", parts[0]).strip() if len(parts) > 1 else ""
    action = ""
    for line in parts[-1].strip().splitlines():
        if line.strip():
            action = " ".join(line.split())
            break
    return thought, action


def _observation(text: str, domain: str) -> str:
    text = _OBS_PREFIX.sub("", text, count=1)
    if domain == "alfworld":
        text = _AVAILABLE.sub("", text)
    return text.strip()


def _goal_and_obs(item: Item, domain: str, text: str, field: str) -> tuple[str, str]:
    text = text.strip()
    if domain == "scienceworld":
        text = re.sub(r"^\s*Task Description:\s*", "", text)
        goal, sep, rest = text.partition("This room is called")
        return goal.strip(), (sep + rest).strip()
    if domain in ("textcraft", "babyai"):
        from hamo_ray.envs.agentgym.protocol import babyai_first, textcraft_first

        try:
            return (textcraft_first if domain == "textcraft" else babyai_first)(_observation(text, domain))
        except ValueError as err:
            raise item.error(field, str(err)) from None
    if domain == "alfworld":
        room, sep, goal = _observation(text, domain).partition("Your task is to:")
        if not sep:
            raise item.error(field, "the task turn has no 'Your task is to:' sentence")
        return goal.strip(), room.strip()
    page = _observation(text, domain)
    m = _INSTRUCTION.search(page)
    if m is None:
        raise item.error(field, "the task turn has no 'Instruction: [SEP] ... [SEP]' page text")
    return m.group(1).strip(), page


def _score(item: Item) -> float:
    for key, scale in (("reward", 100.0), ("score", 1.0)):
        if item.raw.get(key) is not None:
            value = item.raw[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise item.error(key, f"{value!r} is not a number")
            score = float(value) * scale
            if not 0.0 <= score <= 100.0:
                raise item.error(key, f"{value!r} is outside {'0-1' if key == 'reward' else '0-100'}")
            return round(score, 4)
    return 100.0


def _turns(item: Item) -> list[tuple[str, str]]:
    conv = item.raw.get("conversations")
    if not isinstance(conv, list) or not conv:
        raise item.error("conversations", "missing or not a non-empty list of turns")
    turns = []
    for k, turn in enumerate(conv):
        if not isinstance(turn, dict):
            raise item.error(f"conversations[{k}]", "not an object")
        who = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        who = {"user": "human", "assistant": "gpt"}.get(who, who)
        if who not in ("human", "gpt"):
            raise item.error(f"conversations[{k}].from", f"{who!r} is neither 'human' nor 'gpt'")
        if not isinstance(text, str):
            raise item.error(f"conversations[{k}].value", "missing or not a string")
        turns.append((who, text))
    return turns


def parse_item(item: Item, domain: str, store=None) -> Trajectory | None:
    """One item as a ``Trajectory`` (source ``expert``), or None: another environment's item (a mixed
    AgentTraj file), or a task in no split used here."""
    if not isinstance(item.raw, dict):
        raise item.error("<item>", "not an object")
    ids = [str(item.raw[k]) for k in ("item_id", "id") if item.raw.get(k) is not None]
    if ids and (m := re.fullmatch(r"([A-Za-z]+)_\d+", ids[0])) and m.group(1) != AGENTGYM_PREFIX[domain]:
        return None  # another environment's item of a mixed AgentTraj file
    if domain == "scienceworld":
        task = scienceworld_task(item)
    elif domain == "alfworld":
        task = alfworld_task(item, store)
    elif domain in ("textcraft", "babyai"):
        task = agentgym_server_task(item, domain)
    else:
        task = webshop_task(item)
    if task is None:
        return None
    turns = _turns(item)
    start = 0
    if len(turns) > 2 and turns[1][0] == "gpt" and turns[1][1].strip().rstrip(".").lower() in _ACK:
        start = 2  # the dataset's own agent prompt and its acknowledgement
    if turns[start][0] != "human":
        raise item.error(f"conversations[{start}].from", "the task turn must come from 'human'")
    goal, init_obs = _goal_and_obs(item, domain, turns[start][1], f"conversations[{start}].value")
    thoughts, actions, observations = [], [], []
    for k in range(start + 1, len(turns), 2):
        if turns[k][0] != "gpt":
            raise item.error(f"conversations[{k}].from", "expected 'gpt' (turns must alternate)")
        thought, action = split_react(turns[k][1])
        if not action:
            raise item.error(f"conversations[{k}].value", "no action in the reply")
        if k + 1 < len(turns) and turns[k + 1][0] != "human":
            raise item.error(f"conversations[{k + 1}].from", "expected 'human' (turns must alternate)")
        thoughts.append(thought)
        actions.append(action)
        observations.append(_observation(turns[k + 1][1], domain) if k + 1 < len(turns) else "")
    if not actions:
        raise item.error("conversations", "no action turn")
    if domain == "alfworld":
        actions = alfworld_commands(actions, store, task)
    if domain == "scienceworld" and not init_obs and actions[0].lower() == "look around":
        init_obs = observations[0]  # reset() already looks around: its answer is the first observation
        thoughts, actions, observations = thoughts[1:], actions[1:], observations[1:]
    if not goal:
        raise item.error(f"conversations[{start}].value", "empty task")
    return Trajectory(
        task=task,
        goal=goal,
        init_obs=init_obs,
        actions=actions,
        observations=observations,
        thoughts=thoughts if any(thoughts) else [],
        score=_score(item),
        done=True,
        source="expert",
    )


def read_items(path: Path) -> list[Any]:
    """The items of a JSON list or JSON-lines file.

    Raises:
        ExpertDataError: the file is missing or not valid JSON / JSON lines.
    """
    if not path.is_file():
        raise ExpertDataError(f"expert file {path}: does not exist")
    text = path.read_text()
    try:
        if text.lstrip().startswith("["):
            return json.loads(text)
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as err:
        raise ExpertDataError(f"expert file {path}: not a JSON list or JSON lines: {err}") from None


def load_expert_file(path: str | Path, domain: str, cfg: EnvConfig) -> list[Trajectory]:
    """Every item of an AgentGym / ETO file as an expert ``Trajectory`` (see the module docstring).

    Args:
        path: the JSON (list) or JSON-lines file.
        domain: scienceworld, alfworld or webshop.
        cfg: the environment settings (ALFWorld's games; WebShop's backend).

    Returns:
        The trajectories in file order, one per task (later duplicates are dropped, logged).

    Raises:
        ExpertDataError: the file, an item or a field is malformed (named in the message), or the
            domain cannot take imported experts with these settings.
    """
    p = Path(path).expanduser()
    stat = p.stat() if p.is_file() else None
    key = (str(p.resolve()), stat.st_mtime_ns if stat else 0, stat.st_size if stat else 0)
    return list(_load_cached(key, domain, cfg.model_dump_json()))


@functools.lru_cache(maxsize=16)
def _load_cached(key: tuple[str, int, int], domain: str, cfg_json: str) -> tuple[Trajectory, ...]:
    path = Path(key[0])
    cfg = EnvConfig.model_validate_json(cfg_json)
    if domain not in DOMAINS:
        raise ExpertDataError(
            f"env.expert_files: no importer for domain {domain!r} (have {', '.join(DOMAINS)})"
        )
    if domain == "webshop" and cfg.webshop.backend == "standin":
        raise ExpertDataError(
            f"env.expert_files.webshop ({path}): imported WebShop goals need the real WebShop "
            "(env.webshop.backend=text_env or http); the stand-in's tasks are not WebShop's goals"
        )
    store = None
    if domain == "alfworld":
        from hamo_ray.envs.alfworld.domain import GameStore

        store = GameStore(cfg)
        store.check()
    items = read_items(path)
    if not isinstance(items, list):
        raise ExpertDataError(f"expert file {path}: the top level must be a list of items")
    out: dict[str, Trajectory] = {}
    skipped = duplicates = no_obs = 0
    for index, raw in enumerate(items):
        traj = parse_item(Item(path, index, raw), domain, store)
        if traj is None:
            skipped += 1
        elif traj.task.id in out:
            duplicates += 1
        else:
            out[traj.task.id] = traj
            no_obs += not traj.init_obs
    if skipped or duplicates or no_obs:
        logger.warning(
            "expert file %s: %d items skipped (other environments' AgentGym items, ALFWorld's valid_train), "
            "%d duplicate tasks, %d items without an initial observation",
            path,
            skipped,
            duplicates,
            no_obs,
        )
    logger.info("expert file %s: %d %s trajectories", path, len(out), domain)
    return tuple(out.values())


def expert_file(cfg: HamoConfig, domain: str) -> str:
    """The file of ``domain`` in ``env.expert_files``.

    Raises:
        ConfigError: ``env.expert_files`` has no entry for ``domain``.
    """
    files = cfg.env.expert_files
    if domain not in files:
        raise ConfigError(
            f"env.expert_files has no file for domain {domain!r} (env.expert_source=file; has: "
            f"{', '.join(files) or 'none'})"
        )
    return files[domain]


def train_experts_by_type(cfg: HamoConfig, domain: str) -> dict[str, list[Trajectory]]:
    """The file's usable train trajectories of ``domain``, per configured task type, lowest variations first."""
    trajs = load_expert_file(expert_file(cfg, domain), domain, cfg.env)
    by_type: dict[str, list[Trajectory]] = {tt: [] for tt in cfg.task_types(domain)}
    held_out = failed = 0
    for t in trajs:
        if t.task.split != "train":
            held_out += 1
        elif t.score <= 0:
            failed += 1
        elif t.task.task in by_type:
            by_type[t.task.task].append(t)
    if held_out or failed:
        logger.warning(
            "expert file of %s: %d items of dev/test tasks and %d scoring 0 are not trained on",
            domain,
            held_out,
            failed,
        )
    limit = cfg.per_domain("protocol.train_per_task", domain)
    return {tt: sorted(ts, key=lambda t: t.task.variation)[:limit] for tt, ts in by_type.items()}


def stage_experts(cfg: HamoConfig, stage: int) -> list[Trajectory]:
    """The imported expert trajectories of ``stage`` (1-based); see the module docstring.

    Raises:
        ExpertDataError / ConfigError: a bad file, or no usable item for the stage.
    """
    p = cfg.protocol
    if p.kind == "cross_domain":
        domain = p.order[stage - 1]
        chosen = [t for ts in train_experts_by_type(cfg, domain).values() for t in ts]
    else:
        domain = cfg.env.domain
        chosen = []
        for ts in train_experts_by_type(cfg, domain).values():
            chosen += [t for i, t in enumerate(ts) if i % p.num_stages == stage - 1]
    if not chosen:
        raise ExpertDataError(
            f"stage {stage}: the expert file of {domain} ({expert_file(cfg, domain)}) has no scored train "
            f"item of the task types {cfg.task_types(domain)}"
        )
    return chosen
