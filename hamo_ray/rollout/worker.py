"""``EnvWorker``: a Ray actor hosting several environments and running their episodes concurrently.

Environment steps block (ScienceWorld talks to its JVM over py4j), so each runs in a worker thread
while the actor's asyncio loop keeps the other episodes and their policy requests moving. An
environment that raises is closed and replaced, and its episode retried from the start up to
``max_attempts``; after that the episode is recorded as failed with the error, never dropped.

Prompts are built here, with ``hamo_ray.prompting.fit_messages`` (the context rule training examples
use: the whole history, trimmed oldest-first only when the prompt would outgrow the token budget,
counted with the backbone's tokenizer and chat template) and the run's prompt config: the cards are
retrieved from the harness once per episode and the same cards go into every turn, as in the training examples of that trajectory. The policy
endpoint only renders the messages with the chat template (``chat_template_kwargs`` sent along),
so any OpenAI-compatible server (vLLM's own included) can serve rollouts. Replies are parsed in
``prompt.reply_format`` (``prompting.parse_reply``); react thoughts are kept in the trajectory. With
``rollout.constrain_actions`` each request carries a regex of the admissible commands (``action_regex``),
in domains that list them (``Domain.lists_actions``).
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from concurrent.futures import ThreadPoolExecutor

from hamo_ray.config import EnvConfig, PromptConfig
from hamo_ray.prompting import ChatRenderer, action_regex, fit_cards, fit_messages, parse_reply
from hamo_ray.rollout.client import PolicyClient, PolicySpec
from hamo_ray.types import TaskSpec, Trajectory

logger = logging.getLogger(__name__)


def turn_seed(seed: int | None, task: TaskSpec, turn: int) -> int | None:
    """The sampling seed of one turn of one episode: a hash of the stage's seed, the task and the turn
    (None: unseeded)."""
    if seed is None:
        return None
    return zlib.crc32(f"{seed}/{task.id}/{turn}".encode()) & 0x7FFFFFFF


class EnvWorker:
    """Hosts ``n_envs`` environments of one domain; ``run`` plays a list of episodes on them."""

    def __init__(self, domain: str, env_cfg: EnvConfig, prompt_cfg: PromptConfig, n_envs: int) -> None:
        from hamo_ray.envs import get_domain
        from hamo_ray.logs import setup_logging

        setup_logging()
        self.domain = get_domain(domain, env_cfg)
        self.env_cfg = env_cfg
        self.prompt_cfg = prompt_cfg
        self.n_envs = n_envs
        self._free: list = []  # idle environments, created on demand
        self._made = 0
        # Environment calls block, so they run in threads; a domain whose environments share
        # process-global state gets one thread (its episodes still overlap their policy requests).
        threads = n_envs + 2 if self.domain.thread_safe else 1
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="env")
        self._slots = asyncio.Semaphore(n_envs)
        self._renderers: dict[tuple, ChatRenderer] = {}  # (tokenizer folder, template kwargs, budget)

    def _fits(self, spec: PolicySpec):
        """``ChatRenderer.fits`` for the spec's tokenizer and budget (loaded once per actor); None: no limit."""
        if spec.tokenizer is None or spec.prompt_budget is None:
            return None
        key = (spec.tokenizer, repr(sorted(spec.chat_template_kwargs.items())), spec.prompt_budget)
        if key not in self._renderers:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(spec.tokenizer)
            self._renderers[key] = ChatRenderer(tok, spec.chat_template_kwargs, spec.prompt_budget)
        return self._renderers[key].fits

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _take_env(self):
        if self._free:
            return self._free.pop()
        self._made += 1
        return await self._call(self.domain.make_env)

    async def _drop_env(self, env) -> None:
        try:
            await self._call(env.close)
        except Exception:  # the environment is already broken; its process may be gone
            logger.debug("closing a broken environment failed", exc_info=True)

    async def run(
        self, tasks: list[TaskSpec], policy: PolicySpec | None, max_attempts: int = 2
    ) -> list[Trajectory]:
        """Play one episode per task (expert actions when ``policy`` is None); results in task order."""
        client = PolicyClient(policy) if policy is not None else None
        try:
            return list(await asyncio.gather(*(self._episode(t, client, max_attempts) for t in tasks)))
        finally:
            if client is not None:
                await client.aclose()

    async def _episode(self, task: TaskSpec, client: PolicyClient | None, max_attempts: int) -> Trajectory:
        error = "not run"
        async with self._slots:
            for attempt in range(1, max_attempts + 1):
                env = await self._take_env()
                try:
                    traj = await self._play(env, task, client)
                except Exception as exc:  # noqa: BLE001 - any failure is recorded, never dropped
                    error = f"{type(exc).__name__}: {exc}"
                    logger.warning(
                        "episode %s attempt %d/%d failed: %s", task.id, attempt, max_attempts, error
                    )
                    await self._drop_env(env)
                    continue
                self._free.append(env)
                if client is not None:  # progress inside a chunk (the pool reports whole chunks)
                    logger.info(
                        "episode %s: score %.0f in %d turns%s", task.id, traj.score, traj.num_turns,
                        "" if traj.done else " (turn cap)",
                    )  # fmt: skip
                return traj
        return Trajectory(
            task=task, goal="", init_obs="", source="policy" if client else "expert", error=error
        )

    async def _play(self, env, task: TaskSpec, client: PolicyClient | None) -> Trajectory:
        """One episode: the expert's plan (``client`` None) or the served policy, step by step."""
        goal, init_obs = await self._call(env.reset, task)
        actions: list[str] = []
        observations: list[str] = []
        thoughts: list[str] = []  # react format: the thought before each action
        pcfg, react = self.prompt_cfg, self.prompt_cfg.reply_format == "react"
        score, done, tokens = 0.0, False, 0
        if client is None:
            plan = await self._call(env.expert_actions)
            # Cut at the turn cap evaluation stops at: no training step that inference can never reach.
            turns, cards, extra = min(len(plan), self.env_cfg.max_turns), [], {"source": "expert"}
        else:
            # Retrieved once per episode: every turn carries the same cards, as every training
            # example of a trajectory does (and cards_used records them).
            fits, start = self._fits(client.spec), 0
            cards = fit_cards(
                goal, init_obs, await client.retrieve(goal, init_obs), pcfg, domain=task.domain, fits=fits
            )
            turns = self.env_cfg.max_turns
            constrain = client.spec.constrain_actions and self.domain.lists_actions
            extra = {"source": "policy", "model": client.spec.model, "cards_used": [c.id for c in cards]}
        for turn in range(turns):
            if client is None:
                action = plan[turn]
            else:
                start, messages = fit_messages(
                    goal, init_obs, cards, actions, observations, pcfg,
                    domain=task.domain, thoughts=thoughts, start=start, fits=fits,
                )  # fmt: skip
                regex = None
                if constrain:  # the admissible commands now, as one pattern the reply must match
                    regex = action_regex(await self._call(env.valid_actions), pcfg.reply_format)
                seed = turn_seed(client.spec.seed, task, turn)
                reply, used = await client.act(messages, seed=seed, regex=regex)
                tokens += used
                thought, action = parse_reply(reply, pcfg.reply_format)
                if react:
                    thoughts.append(thought)
            step = await self._call(env.step, action)
            actions.append(action)
            observations.append(step.observation)
            score, done = step.score, step.done
            if done:
                break
        return Trajectory(
            task=task,
            goal=goal,
            init_obs=init_obs,
            actions=actions,
            observations=observations,
            thoughts=thoughts,
            score=score,
            done=done,
            policy_tokens=tokens,
            **extra,
        )

    def close(self) -> None:
        for env in self._free:
            try:
                env.close()
            except Exception:
                logger.debug("close failed", exc_info=True)
        self._free.clear()
