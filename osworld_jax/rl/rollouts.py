"""The rollout stage of one RL step: B (+ e) groups of N owners run concurrently (asyncio).

`rollout_step` runs every owner of a step's tasks (streaming train: returns once enough groups
finished, renumbering them), `RawRollouts` is what the env returned, `StepRollouts` the owners
once their segments are built (`osworld_jax.rl.stages.collect_owners`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from osworld_jax.agent import AgentConfig, AgentTokenizer, OwnerAgent, OwnerRollout
from osworld_jax.data import TaskRef
from osworld_jax.errors import InfraError
from osworld_jax.rl.config import RLConfig
from osworld_jax.rollout import SamplingParams, SGLangClient


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepRollouts:
    """The B x N owners of one step, in group-major order (owner ``g * N + j``).

    With streaming train B' <= B groups (`RawRollouts.tasks`) take B's place.

    Attributes:
      tasks: the B task references (group ``g`` is ``tasks[g]``).
      owners: B x N owner rollouts (``group_id`` = g).
      turns: B x N episode lengths (turns taken, unparsed replies included).
      parse_errors: B x N replies that did not parse (``UNPARSED`` turns: nothing ran; empty:
        not recorded).
    """

    tasks: tuple[TaskRef, ...]
    owners: tuple[OwnerRollout, ...]
    turns: tuple[int, ...]
    parse_errors: tuple[int, ...] = ()


def owner_seed(seed: int | None, step: int, owner: int) -> int | None:
    """A per-(step, owner) sampling seed derived from the run seed (stable across resumes)."""
    if seed is None:
        return None
    digest = hashlib.sha256(f"{seed}:{step}:{owner}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


class TimedOwnerAgent(OwnerAgent):
    """An `OwnerAgent` that also measures its episode: wall time and time inside ``act``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.started = time.perf_counter()
        self.act_seconds = 0.0
        self.episode_seconds = 0.0

    async def act(self, observation: Any) -> str:
        """Times `OwnerAgent.act` (prompting + generation)."""
        t0 = time.perf_counter()
        try:
            return await super().act(observation)
        finally:
            self.act_seconds += time.perf_counter() - t0

    async def on_episode_end(self, result: Any) -> None:
        """Records the episode's wall time."""
        self.episode_seconds = time.perf_counter() - self.started
        await super().on_episode_end(result)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RawRollouts:
    """What the env returned for one step, before segments are built.

    Attributes:
      tasks: the B' trained task references (group ``g`` is ``tasks[g]``; B' = B without
        streaming train, at most B with it).
      agents: owner index -> its agent (history, timing).
      results: per group, the env's ``OwnerResult`` list, or the group's exception.
      launched: groups the step rolled out (B + e; None: ``len(tasks)``).
      stragglers: groups still running when the step's rollout returned (cancelled).
      unused: groups that finished but were not trained (beyond B).
    """

    tasks: tuple[TaskRef, ...]
    agents: dict[int, TimedOwnerAgent]
    results: tuple[list[Any] | BaseException, ...]
    launched: int | None = None
    stragglers: int = 0
    unused: int = 0

    def group_metrics(self) -> dict[str, float]:
        """``groups/launched``, ``groups/stragglers`` (cancelled) and ``groups/unused``."""
        launched = len(self.tasks) if self.launched is None else self.launched
        return {
            "groups/launched": float(launched),
            "groups/stragglers": float(self.stragglers),
            "groups/unused": float(self.unused),
        }

    def timing(self) -> dict[str, float]:
        """Per-owner means of the rollout's times, and its prefix-cache hit rate.

        ``time/owner_generate``: seconds spent generating (``act``); ``time/owner_env``: the
        rest of the episode (the sandbox); ``rollout/cache_hit_rate``: the share of the prompt
        tokens sent that the servers took from their prefix caches (SGLang's
        ``cached_tokens``) instead of prefilling them.
        """
        out: dict[str, float] = {}
        served = sum(a.served_tokens for a in self.agents.values())
        if served:
            cached = sum(a.cached_tokens for a in self.agents.values())
            out["rollout/cache_hit_rate"] = cached / served
        eps = [a for a in self.agents.values() if a.episode_seconds > 0]
        if not eps:
            return out
        gen = float(np.mean([a.act_seconds for a in eps]))
        wall = float(np.mean([a.episode_seconds for a in eps]))
        return {**out, "time/owner_generate": gen, "time/owner_env": max(wall - gen, 0.0)}


async def rollout_step(
    agent_env: Any,
    client: SGLangClient,
    tokenizer: AgentTokenizer,
    agent_config: AgentConfig,
    sampling: SamplingParams,
    tasks: Sequence[TaskRef],
    *,
    rl: RLConfig,
    step: int,
    load_task: Any,
) -> RawRollouts:
    """Runs N owners on each of the tasks (B + e of them), all owners at once (asyncio).

    Owner ``g * N + j`` is owner j of group g. A group whose run raised is recorded with its
    exception (`collect_owners` decides what it means). Without streaming train (``rl.streaming``
    False) every group is awaited. With it, the rollout returns once ``rl.min_groups`` groups
    have finished (a group that raised counts): the finished groups are taken in launch order
    (at most B) and renumbered ``0 .. B' - 1`` (owner ids, group ids, result owner indices;
    request ids already sent keep their names, sampling seeds are the launch index's), the
    groups still running are cancelled (``AgentEnv.run_group`` closes their sandboxes) and
    awaited.
    """
    n = rl.num_owners
    agents: dict[int, TimedOwnerAgent] = {}
    attempts: dict[int, int] = {}

    def make_agent(owner: int) -> TimedOwnerAgent:
        # A retried owner (AgentEnvConfig.max_owner_retries) gets a new agent per attempt, with
        # its own request ids; agents[owner] is the latest, whose history the rollout uses.
        k = attempts[owner] = attempts.get(owner, -1) + 1
        agents[owner] = TimedOwnerAgent(
            client,
            tokenizer,
            agent_config,
            owner_id=owner,
            group_id=owner // n,
            sampling=sampling.replace(sampling_seed=owner_seed(rl.seed, step, owner)),
            rid_prefix=f"s{step}" if k == 0 else f"s{step}a{k}",
            action_space=agent_env.config.action_space,
        )
        return agents[owner]

    async def group(g: int, ref: TaskRef) -> list[Any]:
        task = load_task(ref.path)
        return await agent_env.run_group(task, list(range(g * n, (g + 1) * n)), make_agent)

    if not rl.streaming:
        results = await asyncio.gather(
            *(group(g, ref) for g, ref in enumerate(tasks)), return_exceptions=True
        )
        for res in results:
            if isinstance(res, BaseException) and not isinstance(res, Exception):
                raise res  # cancellation / KeyboardInterrupt
        return RawRollouts(tasks=tuple(tasks), agents=agents, results=tuple(results))
    jobs = [asyncio.create_task(group(g, ref)) for g, ref in enumerate(tasks)]
    try:
        pending = set(jobs)
        while pending and len(jobs) - len(pending) < rl.min_groups:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    finally:  # the stragglers (every group, when this wait was itself cancelled)
        for job in jobs:
            job.cancel()  # a no-op for the finished ones
        stragglers = {job for job in jobs if not job.done()}
        await asyncio.gather(*jobs, return_exceptions=True)
    finished = [g for g, job in enumerate(jobs) if job not in stragglers]
    outcomes = {g: _outcome(jobs[g]) for g in finished}  # every exception retrieved
    trained = finished[: rl.num_prompts]
    for g in finished[rl.num_prompts :]:
        out = outcomes[g]
        if isinstance(out, Exception) and not isinstance(out, InfraError):
            raise out  # a bug, even in a group not trained
    return RawRollouts(
        tasks=tuple(tasks[g] for g in trained),
        agents=_renumber(agents, trained, n),
        results=tuple(_renumber_results(outcomes[g], g, new, n) for new, g in enumerate(trained)),
        launched=len(jobs),
        stragglers=len(stragglers),
        unused=len(finished) - len(trained),
    )


def _outcome(job: asyncio.Task[list[Any]]) -> list[Any] | BaseException:
    """A finished group's result or exception (cancellation / KeyboardInterrupt re-raised)."""
    if job.cancelled():
        raise asyncio.CancelledError(f"group task {job.get_name()} was cancelled")
    exc = job.exception()
    if exc is not None and not isinstance(exc, Exception):
        raise exc
    return exc if exc is not None else job.result()


def _renumber(
    agents: dict[int, TimedOwnerAgent], groups: Sequence[int], n: int
) -> dict[int, TimedOwnerAgent]:
    """The agents of launch groups ``groups``, renumbered: group ``groups[i]`` becomes group i."""
    out: dict[int, TimedOwnerAgent] = {}
    for new, g in enumerate(groups):
        for j in range(n):
            agent = agents.get(g * n + j)
            if agent is not None:
                agent.history.owner_id, agent.history.group_id = new * n + j, new
                if agent.result is not None:
                    agent.result = dataclasses.replace(agent.result, owner_index=new * n + j)
                out[new * n + j] = agent
    return out


def _renumber_results(
    res: list[Any] | BaseException, old: int, new: int, n: int
) -> list[Any] | BaseException:
    """Group ``old``'s ``OwnerResult`` list with owner indices moved to group ``new``."""
    if isinstance(res, BaseException) or old == new:
        return res
    shift = (new - old) * n
    return [dataclasses.replace(r, owner_index=r.owner_index + shift) for r in res]
