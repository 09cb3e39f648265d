"""Scoring a finished episode: postconfig, getters, metrics, ``conj`` (OSWorld semantics).

Follows upstream ``DesktopEnv.evaluate``: run the ``postconfig`` steps; ``infeasible`` scores 1
iff the agent's last action is FAIL; otherwise a FAIL answer scores 0; each metric is called as
``metric(result, expected, **options)`` (``metric(result, **options)`` without an expected
getter); with several metrics ``conj="and"`` returns 0 at the first 0 and else the mean,
``conj="or"`` returns 1 at the first 1 and else the maximum.

A ``FileNotFoundError`` from a ``result`` getter scores that metric 0 (upstream does the same);
a 4xx reply to a postconfig ``activate_window`` / ``close_window`` is logged and scoring goes on.

Transient sandbox errors (HTTP 5xx, timeouts, dropped connections: ``protocol.is_transient``)
are retried per call with exponential back-off, so a blip never scores a solved task 0; what
still fails raises ``SandboxEvalError`` (the owner is masked, not scored).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from osworld_jax.env.actions import Action, ActionKind
from osworld_jax.env.backend import SandboxError, SandboxEvalError
from osworld_jax.env.evaluators.registry import GETTERS, METRICS, EvalContext
from osworld_jax.env.protocol import VMProtocol, is_transient
from osworld_jax.env.setup import SetupContext, fill_placeholders, run_setup

if TYPE_CHECKING:
    from osworld_jax.env.tasks import GetterSpec, Task


class RetryingVM:
    """Wraps a ``VMProtocol`` client: each call is retried on transient errors.

    Attributes:
      inner: the wrapped client.
      attempts: total tries per call (>= 1).
      base_delay_s: the first back-off; it doubles per retry.
      retries: how many retries happened (for metrics and tests).
    """

    def __init__(
        self,
        inner: VMProtocol,
        *,
        attempts: int = 4,
        base_delay_s: float = 0.5,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        self.inner = inner
        self.attempts = attempts
        self.base_delay_s = base_delay_s
        self.retries = 0
        self._sleep = sleep

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.inner, name)
        if not callable(fn):
            return fn

        async def call(*args: Any, **kwargs: Any) -> Any:
            for i in range(self.attempts):
                try:
                    return await fn(*args, **kwargs)
                except Exception as e:
                    if not is_transient(e) or i + 1 == self.attempts:
                        raise
                    self.retries += 1
                    await self._sleep(self.base_delay_s * 2**i)
            raise AssertionError("unreachable")

        return call


async def _get(
    spec: GetterSpec | None, vm: VMProtocol, ctx: EvalContext, which: str
) -> tuple[bool, Any]:
    if spec is None:
        return False, None
    if spec.type not in GETTERS:
        raise SandboxEvalError(f"{which} getter {spec.type!r} is not supported")
    params = await fill_placeholders(spec.params, vm)
    return True, await GETTERS.get(spec.type)(vm, params, ctx)


async def evaluate_task(
    task: Task,
    vm: VMProtocol,
    last_action: Action | None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    attempts: int = 4,
    base_delay_s: float = 0.5,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> float:
    """Scores the desktop's final state for ``task``; returns a reward in [0, 1].

    Args:
      task: the task.
      vm: the desktop's in-VM client.
      last_action: the agent's last action (None if it took none).
      cache_dir: the local file cache (``cloud_file`` getters, postconfig ``download``).
      attempts: tries per sandbox call on transient errors.
      base_delay_s: first retry back-off (doubles per retry).
      sleep: the coroutine used for back-off and ``sleep`` steps.

    Raises:
      SandboxEvalError: a getter/metric/step failed (after retries) or is not supported.
    """
    ev = task.evaluator
    rvm = cast(
        VMProtocol, RetryingVM(vm, attempts=attempts, base_delay_s=base_delay_s, sleep=sleep)
    )
    failed = last_action is not None and last_action.kind == ActionKind.FAIL
    base_dir = task.path.parent if task.path is not None else None
    with tempfile.TemporaryDirectory(prefix="osworld-eval-") as tmp:
        work = Path(tmp)
        try:
            await run_setup(
                ev.postconfig,
                rvm,
                ctx=SetupContext(
                    cache_dir=cache_dir,
                    task_id=task.id,
                    base_dir=base_dir,
                    sleep=sleep,
                    work_dir=work,
                ),
            )
            if ev.is_infeasible:
                return float(failed)
            if failed:
                return 0.0
            ctx = EvalContext(
                work_dir=work, cache_dir=cache_dir, task_id=task.id, base_dir=base_dir
            )
            scores: list[float] = []
            for i, name in enumerate(ev.func):
                if name not in METRICS:
                    raise SandboxEvalError(f"task {task.id}: metric {name!r} is not supported")
                if name == "infeasible":
                    score = float(failed)
                else:
                    try:
                        _, result = await _get(ev.result[i], rvm, ctx, "result")
                    except FileNotFoundError:
                        # Upstream: a result file that is not there scores the metric 0.
                        result, score = None, 0.0
                    else:
                        has_exp, expected = await _get(ev.expected[i], rvm, ctx, "expected")
                        metric = METRICS.get(name)
                        opts = dict(ev.options[i])
                        score = float(
                            metric(result, expected, **opts) if has_exp else metric(result, **opts)
                        )
                if not 0.0 <= score <= 1.0:
                    raise SandboxEvalError(f"task {task.id}: metric {name} returned {score}")
                if ev.conj == "and" and score == 0.0:
                    return 0.0
                if ev.conj == "or" and score == 1.0:
                    return 1.0
                scores.append(score)
            return sum(scores) / len(scores) if ev.conj == "and" else max(scores)
        except SandboxEvalError:
            raise
        except SandboxError as e:
            raise SandboxEvalError(f"task {task.id}: evaluation failed: {e}") from e
        except Exception as e:  # noqa: BLE001 - a getter/metric crash is an eval failure
            raise SandboxEvalError(
                f"task {task.id}: evaluation failed: {type(e).__name__}: {e}"
            ) from e
