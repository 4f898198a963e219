"""The item lists of the AgentGym servers served as domains (``textcraft``, ``babyai``): an item index
(``data_idx``, the N of AgentTraj's ``textcraft_<N>``) <-> this project's task (task type, variation,
split). The splits are ours (``hamo_ray.envs.agentgym.domains`` states them).
"""

from __future__ import annotations

from hamo_ray.types import TaskSpec

TEXTCRAFT_DEPTHS = {1: 125, 2: 291, 3: 117, 4: 11}
TEXTCRAFT_NUM_GOALS = sum(TEXTCRAFT_DEPTHS.values())  # 544
BABYAI_LEVELS = (
    "GoToRedBallGrey",
    "GoToRedBall",
    "GoToRedBallNoDists",
    "GoToObjS6",
    "GoToLocalS8N7",
    "GoToObjMazeS7",
    "GoToImpUnlock",
    "GoToSeqS5R2",
    "GoToRedBlueBall",
    "GoToDoor",
    "GoToObjDoor",
    "Open",
    "OpenRedDoor",
    "OpenDoorLoc",
    "OpenRedBlueDoorsDebug",
    "OpenDoorsOrderN4Debug",
    "Pickup",
    "UnblockPickup",
    "PickupLoc",
    "PickupDistDebug",
    "PickupAbove",
    "PutNextLocalS6N4",
    "PutNextS7N4Carrying",
    "Unlock",
    "UnlockLocalDist",
    "KeyInBox",
    "UnlockPickupDist",
    "BlockedUnlockPickup",
    "UnlockToUnlock",
    "ActionObjDoor",
    "FindObjS7",
    "KeyCorridorS6R3",
    "OneRoomS20",
    "MoveTwoAcrossS8N9",
    "SynthS5R2",
    "SynthLoc",
    "SynthSeq",
    "MiniBossLevel",
    "BossLevel",
    "BossLevelNoUnlock",
)  # fmt: skip  (agentenv-babyai's all_levels 1-40, without "BabyAI-" and "-v0")
BABYAI_SEEDS = {"test": range(0, 5), "dev": range(5, 10), "train": range(10, 100)}


def _textcraft_blocks() -> dict[str, range]:
    blocks, start = {}, 0
    for depth, n in TEXTCRAFT_DEPTHS.items():
        blocks[f"depth-{depth}"] = range(start, start + n)
        start += n
    return blocks


TEXTCRAFT_BLOCKS = _textcraft_blocks()


def textcraft_depth(item: int) -> int:
    """The crafting depth of the server's goal ``item`` (mod 544)."""
    item %= TEXTCRAFT_NUM_GOALS
    return next(int(t.split("-")[1]) for t, r in TEXTCRAFT_BLOCKS.items() if item in r)


def textcraft_split(position: int) -> str:
    return {0: "test", 1: "dev"}.get(position % 5, "train")


def textcraft_task(item: int) -> TaskSpec:
    """The task of the server's item ``item`` (``textcraft_<item>``; taken mod 544 as the server does)."""
    item %= TEXTCRAFT_NUM_GOALS
    for task_type, block in TEXTCRAFT_BLOCKS.items():
        if item in block:
            position = item - block.start
            return TaskSpec(
                domain="textcraft", task=task_type, variation=position, split=textcraft_split(position)
            )
    raise AssertionError(item)  # unreachable: the blocks cover 0..543


def textcraft_item(task: TaskSpec) -> int:
    """The server's item index of a textcraft task.

    Raises:
        ValueError: the task is not one of the server's items (named).
    """
    block = TEXTCRAFT_BLOCKS.get(task.task)
    if block is None or not 0 <= task.variation < len(block):
        raise ValueError(f"{task.id}: the AgentGym textcraft server lists no such item")
    return block.start + task.variation


def babyai_task(item: int) -> TaskSpec:
    """The task of the server's item ``item`` (``babyai_<item>``).

    Raises:
        ValueError: the seed lies outside the seeds of this project's splits (0-99).
    """
    level, seed = BABYAI_LEVELS[item % 40], item // 40
    for split, seeds in BABYAI_SEEDS.items():
        if seed in seeds:
            return TaskSpec(domain="babyai", task=level, variation=seed, split=split)
    raise ValueError(f"babyai_{item}: seed {seed} is outside 0-{BABYAI_SEEDS['train'].stop - 1}")


def babyai_item(task: TaskSpec) -> int:
    """The server's item index of a babyai task (``40 x seed + level``).

    Raises:
        ValueError: an unknown level or a seed outside 0-99 (named).
    """
    if task.task not in BABYAI_LEVELS or not 0 <= task.variation < BABYAI_SEEDS["train"].stop:
        raise ValueError(f"{task.id}: the AgentGym babyai server lists no such item here")
    return 40 * task.variation + BABYAI_LEVELS.index(task.task)
