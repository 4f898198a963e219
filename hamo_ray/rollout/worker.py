"""``EnvWorker``: a Ray actor hosting several environments and running their episodes concurrently.

Environment steps block (ScienceWorld talks to its JVM over py4j), so each runs in a worker thread
while the actor's asyncio loop keeps the other episodes and their policy requests moving. An
environment that raises is closed and replaced, and its episode retried from the start up to
``max_attempts``; after that the episode is recorded as failed with the error, never dropped.

Every environment call (make, reset, step, expert plan, valid actions) is bounded by
``rollout.step_timeout_s``: one that does not return in time fails its attempt with
``EnvTimeoutError`` (the episode is retried on a fresh environment like any other failure, and
recorded as failed with that error once its attempts are spent: never a score of 0). The wedged
environment is closed from a thread of its own (a ScienceWorld close kills its JVM, which frees the
blocked py4j call), and the actor moves its environment calls to fresh threads, so a call that never
returns holds nothing else up. The actor answers ``ping`` on its event loop; the pool uses it to
find an actor that is wedged as a whole (``hamo_ray.rollout.pool``).

Prompts are built here, with ``hamo_ray.prompting.fit_messages`` (the context rule training examples
use: the whole history, trimmed oldest-first only when the prompt would outgrow the token budget,
counted with the backbone's tokenizer and chat template) and the run's prompt config: the cards are
retrieved from the harness once per episode and the same cards go into every turn, as in the training examples of that trajectory. The policy
endpoint only renders the messages with the chat template (``chat_template_kwargs`` sent along; the
actors count tokens with the spec's ``chat_template``, ``model.chat_template``, when set),
so any OpenAI-compatible server (vLLM's own included) can serve rollouts. Replies are parsed in
``prompt.reply_format`` (``prompting.parse_reply``); react thoughts are kept in the trajectory. With
``rollout.constrain_actions`` each request carries a regex of the admissible commands (``action_regex``),
in domains that list them (``Domain.lists_actions``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from hamo_ray.chat import set_chat_template
from hamo_ray.config import EnvConfig, PromptConfig
from hamo_ray.prompting import ChatRenderer, action_regex, fit_cards, fit_messages, parse_reply
from hamo_ray.rollout.client import PolicyClient, PolicySpec
from hamo_ray.types import TaskSpec, Trajectory

if TYPE_CHECKING:
    from hamo_ray.envs.base import Domain

logger = logging.getLogger(__name__)


class EnvTimeoutError(TimeoutError):
    """An environment call ran past ``rollout.step_timeout_s``; its environment is closed and replaced."""


def turn_seed(seed: int | None, task: TaskSpec, turn: int) -> int | None:
    """The sampling seed of one turn of one episode: a hash of the stage's seed, the task and the turn
    (None: unseeded)."""
    if seed is None:
        return None
    return zlib.crc32(f"{seed}/{task.id}/{turn}".encode()) & 0x7FFFFFFF


class EnvWorker:
    """Hosts ``n_envs`` environments of one domain; ``run`` plays a list of episodes on them.

    ``domain``: a registered domain's name, or a ``Domain`` instance (one the actor's process cannot
    look up by name, e.g. a test's; it travels pickled).
    """

    def __init__(
        self,
        domain: str | Domain,
        env_cfg: EnvConfig,
        prompt_cfg: PromptConfig,
        n_envs: int,
        step_timeout_s: float | None = None,
    ) -> None:
        from hamo_ray.envs import get_domain
        from hamo_ray.logs import setup_logging

        setup_logging()
        self.domain = get_domain(domain, env_cfg) if isinstance(domain, str) else domain
        self.env_cfg = env_cfg
        self.prompt_cfg = prompt_cfg
        self.n_envs = n_envs
        self.step_timeout_s = step_timeout_s  # bound of one environment call; None: unbounded
        self._free: list = []  # idle environments, created on demand
        self._made = 0
        self._timeouts = 0  # environment calls that ran past step_timeout_s
        # Environment calls block, so they run in threads; a domain whose environments share
        # process-global state gets one thread (its episodes still overlap their policy requests).
        self._threads = n_envs + 2 if self.domain.thread_safe else 1
        self._executor = self._new_executor()
        self._slots = asyncio.Semaphore(n_envs)
        self._renderers: dict[tuple, ChatRenderer] = {}  # (tokenizer folder, template, its kwargs, budget)
        self._renderer_lock = asyncio.Lock()

    def _new_executor(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="env")

    async def ping(self) -> int:
        """This actor's process id, answered on its event loop (a wedged loop does not answer)."""
        return os.getpid()

    def stats(self) -> dict[str, int]:
        """Environments made and environment calls timed out since this actor (re)started."""
        return {"made": self._made, "timeouts": self._timeouts, "idle": len(self._free)}

    async def _fits(self, spec: PolicySpec):
        """``ChatRenderer.fits`` for the spec's tokenizer and budget (loaded once per actor); None: no limit."""
        if spec.tokenizer is None or spec.prompt_budget is None:
            return None
        kwargs = repr(sorted(spec.chat_template_kwargs.items()))
        key = (spec.tokenizer, spec.chat_template, kwargs, spec.prompt_budget)
        async with self._renderer_lock:  # loaded in a thread: the event loop keeps answering pings
            if key not in self._renderers:
                from transformers import AutoTokenizer

                tok = await asyncio.to_thread(AutoTokenizer.from_pretrained, spec.tokenizer)
                set_chat_template(tok, spec.chat_template)  # model.chat_template, as the server renders
                self._renderers[key] = ChatRenderer(tok, spec.chat_template_kwargs, spec.prompt_budget)
        return self._renderers[key].fits

    async def _call(self, what: str, fn, *args, late=None):
        """``fn(*args)`` in the environment threads, bounded by ``step_timeout_s``.

        Raises:
            EnvTimeoutError: the call did not return in time. The thread it blocks is left behind: later
                calls run on fresh threads. ``late`` is called with the call's result if it ever comes
                (e.g. to close an environment whose making timed out).
        """
        call: Future = self._executor.submit(fn, *args)
        if self.step_timeout_s is None:
            return await asyncio.wrap_future(call)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(call), self.step_timeout_s)
        except asyncio.TimeoutError:
            self._timeouts += 1
            if late is not None:
                call.add_done_callback(lambda f: f.cancelled() or f.exception() or late(f.result()))
            stuck, self._executor = self._executor, self._new_executor()
            stuck.shutdown(wait=False)  # its other calls still run; nothing new goes to the stuck thread
            raise EnvTimeoutError(
                f"{what} did not return within rollout.step_timeout_s={self.step_timeout_s:g}s"
            ) from None

    async def _take_env(self):
        if self._free:
            return self._free.pop()
        self._made += 1
        return await self._call("make_env()", self.domain.make_env, late=_close_quietly)

    async def _drop_env(self, env) -> None:
        """Close a broken or wedged environment from a thread of its own, waiting at most step_timeout_s."""
        loop = asyncio.get_running_loop()
        closed = loop.create_future()

        def close() -> None:
            _close_quietly(env)
            try:
                loop.call_soon_threadsafe(lambda: closed.done() or closed.set_result(None))
            except RuntimeError:  # the loop is gone (the actor is exiting)
                pass

        threading.Thread(target=close, name="env-close", daemon=True).start()
        try:
            await asyncio.wait_for(closed, self.step_timeout_s)
        except asyncio.TimeoutError:
            logger.error("closing an environment took over %gs; left behind", self.step_timeout_s)

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
                env = None
                try:
                    env = await self._take_env()
                    traj = await self._play(env, task, client)
                except Exception as exc:  # noqa: BLE001 - any failure is recorded, never dropped
                    error = f"{type(exc).__name__}: {exc}"
                    logger.warning(
                        "episode %s attempt %d/%d failed: %s", task.id, attempt, max_attempts, error
                    )
                    if env is not None:  # closed and replaced: the next attempt makes a fresh one
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
        goal, init_obs = await self._call(f"reset({task.id})", env.reset, task)
        actions: list[str] = []
        observations: list[str] = []
        thoughts: list[str] = []  # react format: the thought before each action
        pcfg, react = self.prompt_cfg, self.prompt_cfg.reply_format == "react"
        score, done, tokens = 0.0, False, 0
        if client is None:
            plan = await self._call("expert_actions()", env.expert_actions)
            # Cut at the turn cap evaluation stops at: no training step that inference can never reach.
            turns, cards, extra = min(len(plan), self.env_cfg.max_turns), [], {"source": "expert"}
        else:
            # Retrieved once per episode: every turn carries the same cards, as every training
            # example of a trajectory does (and cards_used records them).
            fits, start = await self._fits(client.spec), 0
            retrieved, withheld = await client.recall(goal, init_obs, task.domain)
            cards = fit_cards(goal, init_obs, retrieved, pcfg, domain=task.domain, fits=fits)
            turns = self.env_cfg.max_turns
            constrain = client.spec.constrain_actions and self.domain.lists_actions
            extra = {
                "source": "policy", "model": client.spec.model, "cards_used": [c.id for c in cards],
                "cards_withheld": withheld, "cards_dropped": len(retrieved) - len(cards),
            }  # fmt: skip
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
                    valid = await self._call("valid_actions()", env.valid_actions)
                    regex = action_regex(valid, pcfg.reply_format)
                seed = turn_seed(client.spec.seed, task, turn)
                reply, used = await client.act(messages, seed=seed, regex=regex)
                tokens += used
                thought, action = parse_reply(reply, pcfg.reply_format)
                if react:
                    thoughts.append(thought)
            step = await self._call(f"step({action!r})", env.step, action)
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
            _close_quietly(env)
        self._free.clear()


def _close_quietly(env) -> None:
    try:
        env.close()
    except Exception:  # the environment is already broken; its process may be gone
        logger.debug("closing an environment failed", exc_info=True)
