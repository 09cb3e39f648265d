"""AgentEnv: init a task's sandbox once, fork it for exactly the active owners, run their loops.

For one prompt group: ``backend.create(task)`` runs the task's setup once; ``backend.fork(base,
n)`` copies the initialised state for exactly the ``n`` active owners (no fork for none); each
owner claims its fork and runs ``observation -> await agent.act(obs) -> parse_action -> step``
until DONE, FAIL or ``max_turns``, then the sandbox evaluates. An infrastructure failure
(``InfraError``/``SandboxError``, a timeout) fails only that owner (reward None, error text);
its siblings continue. Every sandbox is closed before ``run_group`` returns, also after failures
and on cancellation (the backend's ``inventory()`` is empty again). Unparsable model output is
neither a failure nor an answer: an ``UNPARSED`` action runs nothing, spends its turn and the
episode continues (as upstream OSWorld's agents: no code parsed, no action run, next step); it is
counted (``OwnerResult.parse_errors``, ``env/parse_errors``) and never becomes the last action
the evaluator sees (that is the last action run, as upstream's ``action_history[-1]``), so
gibberish never scores as ``FAIL`` on an infeasible task.

With ``max_owner_retries > 0`` the base stays open until every owner is final (it is the group's
initialised task state): an owner that failed for an infrastructure reason is run again, alone,
on ``backend.fork(base, 1)`` with a fresh agent, up to ``max_owner_retries`` more times. Its
siblings are never re-run or disturbed; only the final attempt's agent sees ``on_episode_end``
(earlier attempts' agents are dropped, so a retry adds no optimizer rows).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from osworld_jax.env.actions import Action, ActionKind, ActionSpace, parse_action
from osworld_jax.env.backend import (
    Observation,
    Sandbox,
    SandboxBackend,
    SandboxCreateError,
    SandboxError,
    SandboxEvalError,
    SandboxTimeout,
)
from osworld_jax.env.protocol import is_transient
from osworld_jax.env.tasks import Task
from osworld_jax.errors import ConfigError, InfraError
from osworld_jax.registry import check_choice

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentEnvConfig:
    """How AgentEnv drives sandboxes.

    Attributes:
      max_turns: agent turns per episode; the episode ends (and is evaluated) after this many.
      action_space: ``pyautogui`` or ``computer_13`` (how model text is parsed).
      create_timeout_s: limit for ``backend.create`` (the task's setup included).
      fork_timeout_s: limit for ``backend.fork``.
      step_timeout_s: limit for one ``observe``/``step``.
      act_timeout_s: limit for one ``agent.act`` (None: no limit; the rollout client has its own).
      eval_timeout_s: limit for one ``sandbox.evaluate`` attempt.
      eval_attempts: tries of ``sandbox.evaluate`` on transient errors (5xx, timeouts).
      eval_retry_delay_s: the first back-off between evaluation attempts (doubles per retry).
      close_timeout_s: limit for closing one sandbox.
      max_owner_retries: extra attempts of an owner whose episode failed for an infrastructure
        reason (``InfraError``/``SandboxError``: not a bad action or a low reward), each on a
        fresh ``fork(base, 1)`` of the group's initialised sandbox with a fresh agent. 0: none,
        and the base is closed as soon as it is forked; > 0 keeps the base open until every
        owner of the group is final (one more live sandbox per group).
    """

    max_turns: int = 15
    action_space: ActionSpace = "pyautogui"
    create_timeout_s: float = 600.0
    fork_timeout_s: float = 600.0
    step_timeout_s: float = 120.0
    act_timeout_s: float | None = None
    eval_timeout_s: float = 600.0
    eval_attempts: int = 3
    eval_retry_delay_s: float = 1.0
    close_timeout_s: float = 60.0
    max_owner_retries: int = 0

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ConfigError(f"AgentEnvConfig.max_turns must be >= 1, got {self.max_turns}")
        if self.eval_attempts < 1:
            raise ConfigError(
                f"AgentEnvConfig.eval_attempts must be >= 1, got {self.eval_attempts}"
            )
        if self.max_owner_retries < 0:
            raise ConfigError(
                f"AgentEnvConfig.max_owner_retries must be >= 0, got {self.max_owner_retries}"
            )
        check_choice(self.action_space, ActionSpace, "AgentEnvConfig.action_space", "action space")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OwnerResult:
    """One logical owner's episode.

    Attributes:
      owner_index: the owner's index within its group (as passed to ``run_group``).
      reward: the evaluator's reward in [0, 1], or None when the owner failed.
      failed: True for an infrastructure failure (the owner is masked, not trained on).
      error: the failure, one line, or None.
      turns: how many agent turns ran.
      actions: the raw model text of each turn.
      parse_errors: per turn (aligned with ``actions``), why its text did not parse (an
        ``UNPARSED`` turn: nothing ran), else None.
      attempts: how many episodes the owner ran (> 1 after infrastructure retries,
        ``AgentEnvConfig.max_owner_retries``); every other field is the last attempt's.
    """

    owner_index: int
    reward: float | None
    failed: bool
    error: str | None
    turns: int
    actions: tuple[str, ...]
    parse_errors: tuple[str | None, ...] = ()
    attempts: int = 1

    @property
    def num_parse_errors(self) -> int:
        """Turns whose reply did not parse."""
        return sum(e is not None for e in self.parse_errors)


class Agent(Protocol):
    """What ``make_agent(owner_index)`` returns (``on_episode_end`` is optional)."""

    async def act(self, observation: Observation) -> str:
        """The model's raw reply to ``observation``."""
        ...


MakeAgent = Callable[[int], "Agent | Awaitable[Agent]"]


@dataclasses.dataclass
class EnvMetrics:
    """Counters of sandbox activity (monotonic over an AgentEnv's life).

    Attributes:
      groups: ``run_group`` calls.
      creates: sandboxes created (base sandboxes).
      forks: forked sandboxes handed to owners.
      create_failures: failed or timed-out creates.
      fork_failures: failed or timed-out forks (a retry's ``fork(base, 1)`` included).
      owner_failures: owners that ended failed (final results only; retried attempts are not).
      owner_retries: owner episodes re-run after an infrastructure failure.
      steps: actions stepped.
      parse_errors: replies that did not parse (``UNPARSED`` turns: nothing stepped).
      evaluations: successful evaluations.
      eval_retries: evaluation retries after transient errors.
      timeouts: operations that hit their limit.
    """

    groups: int = 0
    creates: int = 0
    forks: int = 0
    create_failures: int = 0
    fork_failures: int = 0
    owner_failures: int = 0
    owner_retries: int = 0
    steps: int = 0
    parse_errors: int = 0
    evaluations: int = 0
    eval_retries: int = 0
    timeouts: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counters, keyed ``env/<name>`` (for the metrics writer)."""
        return {f"env/{k}": v for k, v in dataclasses.asdict(self).items()}


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".strip()


class AgentEnv:
    """Runs prompt groups of owners against a sandbox backend (see the module docstring)."""

    def __init__(self, backend: SandboxBackend, config: AgentEnvConfig) -> None:
        self.backend = backend
        self.config = config
        self.metrics = EnvMetrics()

    async def _timed(self, aw: Awaitable[Any], limit: float | None, what: str) -> Any:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation that
        # lands as the inner awaitable finishes, and the owner then runs on after Ctrl-C.
        try:
            async with asyncio.timeout(limit):
                return await aw
        except TimeoutError as e:
            self.metrics.timeouts += 1
            raise SandboxTimeout(f"{what} exceeded {limit:g} s") from e

    async def _close(self, sandboxes: Sequence[Sandbox]) -> None:
        async def close_one(sb: Sandbox) -> None:
            try:
                async with asyncio.timeout(self.config.close_timeout_s):
                    await sb.close()
            except Exception:  # noqa: BLE001 - closing is best effort; inventory() tells the truth
                pass

        if sandboxes:
            # Shielded: a second cancellation must not leave sandboxes half-closed.
            await asyncio.shield(asyncio.gather(*(close_one(sb) for sb in sandboxes)))

    async def run_group(
        self, task: Task, owner_indices: Sequence[int], make_agent: MakeAgent
    ) -> list[OwnerResult]:
        """Runs one episode per owner of ``owner_indices`` on forks of one initialised sandbox.

        Args:
          task: the task.
          owner_indices: the active owners (exactly this many forks; none for an empty list).
          make_agent: ``owner_index -> agent`` (or an awaitable of one).

        Returns:
          One ``OwnerResult`` per owner, in the order of ``owner_indices``.

        Raises:
          Exception: anything that is not an infrastructure failure (a bug) propagates, after
            every sandbox is closed; ``asyncio.CancelledError`` likewise.
        """
        self.metrics.groups += 1
        owners = list(owner_indices)
        if not owners:
            return []
        if len(set(owners)) != len(owners):
            raise ValueError(f"run_group: duplicate owner indices {owners}")
        cfg = self.config
        base: Sandbox | None = None
        forks: list[Sandbox] = []
        try:
            try:
                base = await self._timed(
                    self.backend.create(task), cfg.create_timeout_s, f"create({task.id})"
                )
                self.metrics.creates += 1
            except (InfraError, SandboxError) as e:
                self.metrics.create_failures += 1
                return self._all_failed(owners, f"create failed: {_one_line(e)}")
            assert base is not None
            try:
                forks = await self._fork(task, base, len(owners))
            except (InfraError, SandboxError) as e:
                self.metrics.fork_failures += 1
                return self._all_failed(owners, f"fork failed: {_one_line(e)}")
            template: Sandbox | None = base
            if cfg.max_owner_retries == 0:
                # The base is only a template once forked: free it before the episodes run.
                await self._close([base])
                template = None
            jobs = [
                asyncio.create_task(self._run_owner(task, o, sb, make_agent, template))
                for o, sb in zip(owners, forks, strict=True)
            ]
            try:
                return list(await asyncio.gather(*jobs))
            except BaseException:
                for j in jobs:
                    j.cancel()
                await asyncio.gather(*jobs, return_exceptions=True)
                raise
        finally:
            await self._close([*forks, *([base] if base is not None else [])])

    async def _fork(self, task: Task, base: Sandbox, n: int) -> list[Sandbox]:
        """``backend.fork(base, n)`` under ``fork_timeout_s``; exactly n sandboxes or an error."""
        forks = list(
            await self._timed(
                self.backend.fork(base, n), self.config.fork_timeout_s, f"fork({task.id}, {n})"
            )
        )
        if len(forks) != n:
            await self._close(forks)
            raise SandboxCreateError(f"backend returned {len(forks)} forks for {n} owners")
        self.metrics.forks += n
        return forks

    def _all_failed(self, owners: Sequence[int], error: str) -> list[OwnerResult]:
        self.metrics.owner_failures += len(owners)
        return [
            OwnerResult(owner_index=o, reward=None, failed=True, error=error, turns=0, actions=())
            for o in owners
        ]

    async def _evaluate(self, sb: Sandbox, last: Action | None) -> float:
        cfg = self.config
        for i in range(cfg.eval_attempts):
            try:
                return float(
                    await self._timed(sb.evaluate(last), cfg.eval_timeout_s, f"evaluate({sb.id})")
                )
            except (InfraError, SandboxError) as e:
                cause = e.__cause__ if isinstance(e, SandboxEvalError) else None
                if not (is_transient(e) or (cause is not None and is_transient(cause))):
                    raise
                if i + 1 == cfg.eval_attempts:
                    raise
                self.metrics.eval_retries += 1
                await asyncio.sleep(cfg.eval_retry_delay_s * 2**i)
        raise AssertionError("unreachable")

    async def _run_owner(
        self,
        task: Task,
        owner: int,
        sb: Sandbox,
        make_agent: MakeAgent,
        base: Sandbox | None,
    ) -> OwnerResult:
        """Runs the owner's episode on ``sb``; with a ``base``, retries infrastructure failures.

        Each retry runs on ``fork(base, 1)`` with a fresh ``make_agent(owner)``; only the final
        attempt's agent gets ``on_episode_end``.
        """
        cfg = self.config
        attempt = 1
        result, agent = await self._episode(task, owner, sb, make_agent)
        while result.failed and base is not None and attempt <= cfg.max_owner_retries:
            log.warning(
                "task %s owner %d: attempt %d of %d failed (%s); retrying on a fork of the "
                "group's initialised sandbox",
                task.id,
                owner,
                attempt,
                cfg.max_owner_retries + 1,
                result.error,
            )
            try:
                (sb,) = await self._fork(task, base, 1)
            except (InfraError, SandboxError) as e:
                self.metrics.fork_failures += 1
                result = dataclasses.replace(
                    result,
                    error=f"retry fork failed: {_one_line(e)} (after attempt {attempt}: "
                    f"{result.error})",
                )
                break
            self.metrics.owner_retries += 1
            attempt += 1
            result, agent = await self._episode(task, owner, sb, make_agent)
        result = dataclasses.replace(result, attempts=attempt)
        if result.failed:
            self.metrics.owner_failures += 1
        hook = getattr(agent, "on_episode_end", None)
        if hook is not None:
            out = hook(result)
            if inspect.isawaitable(out):
                await out
        return result

    async def _episode(
        self, task: Task, owner: int, sb: Sandbox, make_agent: MakeAgent
    ) -> tuple[OwnerResult, Any]:
        """One episode of ``owner`` on ``sb`` (closed afterwards): its result and its agent."""
        cfg = self.config
        texts: list[str] = []
        errors: list[str | None] = []
        agent: Any = None
        try:
            agent = make_agent(owner)
            if inspect.isawaitable(agent):
                agent = await agent
            obs = await self._timed(sb.observe(), cfg.step_timeout_s, f"observe({sb.id})")
            last: Action | None = None  # the last action run (upstream's action_history[-1])
            # A sandbox whose toy reward reads the reply text (osworld_jax/demo) also sees the
            # last UNPARSED reply when no action ran; every real backend sees only actions run.
            reply: Action | None = None
            for _ in range(cfg.max_turns):
                text = await self._timed(agent.act(obs), cfg.act_timeout_s, f"act(owner {owner})")
                texts.append(text)
                action = parse_action(text, cfg.action_space)
                errors.append(action.parse_error)
                if action.kind == ActionKind.UNPARSED:  # the turn is spent, nothing runs
                    self.metrics.parse_errors += 1
                    reply = action if getattr(sb, "scores_replies", False) else None
                    continue
                last = action
                if last.is_terminal:
                    break
                obs = await self._timed(sb.step(last), cfg.step_timeout_s, f"step({sb.id})")
                self.metrics.steps += 1
            reward = await self._evaluate(sb, last if last is not None else reply)
            self.metrics.evaluations += 1
            result = OwnerResult(
                owner_index=owner,
                reward=reward,
                failed=False,
                error=None,
                turns=len(texts),
                actions=tuple(texts),
                parse_errors=tuple(errors),
            )
        except (InfraError, SandboxError) as e:
            result = OwnerResult(
                owner_index=owner,
                reward=None,
                failed=True,
                error=_one_line(e),
                turns=len(texts),
                actions=tuple(texts),
                parse_errors=tuple(errors),
            )
        finally:
            await self._close([sb])
        return result, agent
