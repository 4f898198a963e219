"""ALFWorld (the ``alfworld`` package: TextWorld's PDDL engine, ALFRED's domain and grammar) as a HaMo domain.

Usage::

    domain = get_domain("alfworld", EnvConfig(domain="alfworld"))
    tasks = domain.tasks("test", "pick_heat_then_place_in_recep", limit=3)
    with domain.make_env() as env:
        goal, obs = env.reset(tasks[0])     # "put a hot egg in fridge.", "You are in the middle of a room ..."
        for action in env.expert_actions(): # the handcoded expert's winning commands
            result = env.step(action)       # StepResult(observation, reward, done, score 0 or 100)

- **Task types**: ALFWorld's six (``pick_and_place_simple``, ``look_at_obj_in_light``,
  ``pick_clean_then_place_in_recep``, ``pick_heat_then_place_in_recep``, ``pick_cool_then_place_in_recep``,
  ``pick_two_obj_and_place``); another name is a ``ConfigError`` naming it.
- **Games** (``env.alfworld.games``): ``official`` (the default) uses the downloaded games, in the layout
  ``alfworld-download`` fills: ``$ALFWORLD_DATA/json_2.1.1/{train,valid_seen,valid_unseen}/<task>-.../trial_.../
  game.tw-pddl`` (root: ``env.alfworld.data``, else ``$ALFWORLD_DATA``, else ``~/.cache/alfworld``). Splits:
  ``train`` = train, ``dev`` = valid_seen, ``test`` = valid_unseen; a split's games of one type, sorted by
  path, are its variations (movable/sliced trials and unsolvable games skipped, as ``AlfredTWEnv`` does).
  Missing official games stop a run before any work (``GameStore.check``: a ``ConfigError`` naming
  ``env.alfworld.games`` and the folder); nothing is substituted. ``generated`` (asked for explicitly,
  e.g. by the tiny presets, since the official games cannot be downloaded here) makes ALFRED-style games
  with ``generate.py`` (rooms: ``layout.py``; validation: ``expert.py``) on the package's own PDDL
  domain, grammar and room layouts, in the same layout,
  under ``env.alfworld.games_dir`` (default ``~/.cache/hamo_ray/alfworld/<generator version>-seed<seed>``),
  ``env.alfworld.games_per_task`` variations per task type and split; their scores are not comparable
  with published ALFWorld numbers. Train/dev use ALFRED's train floor plans (dev: other placements,
  like valid_seen), test its held-out floor plans (like valid_unseen): train and test never share a room.
  Building the domain and listing its ``tasks()`` generate nothing (so config checks stay fast); a
  game is generated when an episode first loads it (``reset()``) and cached; deterministic in (seed,
  split, task type, variation), and written atomically, so concurrent actors may race for it safely.
- **Env**: the stack of ``AlfredTWEnv``/``alfworld-generate`` (``textworld.envs.PddlEnv`` +
  ``AlfredDemangler`` + ``AlfredInfos``), one game at a time, synchronous (no gym batch processes). The
  goal is the task sentence, the first observation the room description (banner and task line removed).
  Score: 100 once the game is won, else 0 (ALFWorld's success); done when won or after ``env.max_turns``
  steps. A command that is not admissible (malformed, empty, unicode, 100k characters) gets the engine's
  own "Nothing happens."; none raises. ``valid_actions()`` = the admissible commands (computed by the
  engine on every step anyway).
- **Expert**: ``expert_actions()`` is a full plan: the stored walkthrough (the handcoded expert's
  commands, recorded with a seeded ``random``, since that expert draws from the global ``random``);
  for an official game without one, the handcoded expert is played on it once (planner as fallback).
- **Cost**, CPU seconds on this 2-core machine (wall time was 2-10x more while other jobs loaded it):
  load+reset of a game 0.26-0.6 s in living rooms, bedrooms and bathrooms, 0.6-2.2 s in big kitchens
  (loading and resetting each translate the PDDL problem to SAS twice); a reset of the game already
  loaded 0.13 s (no reload); a step median 42 ms, p90 81 ms, max 0.18 s (every step derives the text of
  all admissible commands); generating one validated game 2-30 s (the expert run dominates; kitchens
  are the slow rooms, and a failed attempt is retried). Memory: ~50 MB for the first env of a process
  (textworld, fast-downward, tatsu), then ~2-5 MB per further env with its game loaded (11 envs with
  11 games loaded: 133 MB RSS); each env loads its own copy of fast-downward's shared library
  (``fast_downward.load_lib`` copies it), so envs in one process do not share planner state and can
  step in parallel threads (the textworld parser underneath cannot: see ``AlfWorldDomain.thread_safe``).
- **Pitfalls** handled here: fast-downward's ``pddl2sas`` overwrites ``sys.argv`` on every load/reset
  (restored by ``expert.keep_argv``); the handcoded expert draws from the global ``random`` (seeded
  and restored around expert runs); ``import alfworld`` creates ``~/.cache/alfworld`` and sets
  ``$ALFWORLD_DATA`` (so only done lazily, on first use).
"""

from __future__ import annotations

from hamo_ray.envs.alfworld.domain import AlfWorldConfig, AlfWorldDomain, AlfWorldEnv

__all__ = ["AlfWorldConfig", "AlfWorldDomain", "AlfWorldEnv"]
