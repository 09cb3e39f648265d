"""Rollouts ahead of training: the asynchronous side of the RL loop (``RLConfig.max_staleness``).

`RolloutProducer` draws each step's tasks from the task stream and starts its rollout at most
``max_staleness`` steps ahead of the step that trains: with k = 0 a step's rollout runs when the
step asks for it (the synchronous loop, unchanged); with k >= 1 the rollouts of steps ``s + 1
.. s + k`` run on the event loop's thread (`LoopThread`) while step ``s`` trains and refits, so
their tokens come from weights at most k optimizer steps older than the ones they are trained
from (`stages.check_window` validates it token by token).

The task stream's position goes into each step's checkpoint as it was right after that step's
tasks were drawn (`Launched.data_state`), not at save time (when later steps' tasks have been
drawn already): a resumed run draws the first step it has not trained, and rollouts that were in
flight when the run stopped are simply run again.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, Self, TypeVar

from osworld_jax.data import TaskRef

T = TypeVar("T")


class LoopThread:
    """An asyncio event loop on its own thread: `asyncio.Runner`'s ``run`` plus ``submit``.

    ``run(coro)`` blocks until ``coro`` is done (as ``asyncio.Runner.run``; an interrupt while
    waiting cancels it); ``submit(coro)`` returns at once with a ``concurrent.futures.Future``.
    ``close`` cancels what still runs, waits for it to unwind (sandboxes closed), then stops the
    loop.
    """

    def __init__(self, name: str = "osworld_jax-rollout") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Starts ``coro`` on the loop; its future."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs ``coro`` on the loop and waits for it (cancelled if the wait is interrupted)."""
        future = self.submit(coro)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # `close` waits for it to unwind
            raise

    def cancel_all(self) -> None:
        """Cancels every task on the loop and waits until they have unwound."""

        async def cancel() -> None:
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(cancel(), self._loop).result()

    def close(self) -> None:
        """Cancels every task still running, then stops and closes the loop."""
        if self._loop.is_closed():
            return
        self.cancel_all()

        async def shutdown() -> None:
            await self._loop.shutdown_asyncgens()
            await self._loop.shutdown_default_executor()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result()
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


@dataclasses.dataclass(kw_only=True)
class Launched:
    """One step's rollout, drawn and (with ``max_staleness >= 1``) started.

    Attributes:
      step: the step it trains.
      tasks: its B tasks.
      data_state: the task stream's state right after ``tasks`` were drawn (the checkpoint's).
      future: the running rollout; None until the step takes it (synchronous) or on processes
        that do not roll out.
      launched_at: ``time.perf_counter()`` when it started (None: not started).
      finished_at: when the rollout finished (set by `RolloutProducer.take`).
      weights_step: the newest weights served when it started (``step - 1 - max_staleness`` at
        the earliest).
    """

    step: int
    tasks: list[TaskRef]
    data_state: Any
    future: concurrent.futures.Future[Any] | None = None
    launched_at: float | None = None
    finished_at: float | None = None
    weights_step: int = 0


class RolloutProducer:
    """Draws steps' tasks and runs their rollouts up to ``max_staleness`` steps ahead.

    Args:
      stream: the task stream (``next`` gives a step's tasks; ``get_state`` its position).
      rollout: ``rollout(tasks, step)``, the step's rollout coroutine (None on a process that
        does not roll out: it only draws, so every process's stream stays in step).
      runner: runs coroutines: an `asyncio.Runner` for k = 0, a `LoopThread` for k >= 1.
      max_staleness: k.
      last_step: the run's last step (nothing is drawn beyond it).
      first_step: the first step it draws.
      groups_per_step: the rollout groups of one step (B + e).
      max_buffered_groups: with k >= 1, a step after the current one is launched only while the
        groups of the started, unfinished rollouts (``groups_per_step`` each) plus its own stay
        within this cap (``RLConfig.max_buffered_rollouts``; None: no cap); the current step
        always launches.
    """

    def __init__(
        self,
        stream: Any,
        rollout: Callable[[list[TaskRef], int], Coroutine[Any, Any, Any]] | None,
        runner: Any,
        *,
        max_staleness: int,
        last_step: int,
        first_step: int,
        groups_per_step: int = 1,
        max_buffered_groups: int | None = None,
    ) -> None:
        if max_staleness > 0 and not isinstance(runner, LoopThread):
            raise TypeError("RolloutProducer: max_staleness >= 1 needs a LoopThread runner")
        self.stream, self.rollout, self.runner = stream, rollout, runner
        self.max_staleness, self.last_step = max_staleness, last_step
        self.groups_per_step, self.max_buffered_groups = groups_per_step, max_buffered_groups
        self._next = first_step
        self._queue: collections.deque[Launched] = collections.deque()
        self.started_at = time.perf_counter()  # the timeline's origin

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def in_flight(self) -> int:
        """Rollouts started and not yet taken."""
        return sum(1 for x in self._queue if x.future is not None)

    @property
    def running_groups(self) -> int:
        """Rollout groups running: ``groups_per_step`` per started, unfinished rollout."""
        running = sum(1 for x in self._queue if x.future is not None and not x.future.done())
        return running * self.groups_per_step

    def launch_through(self, step: int, weights_step: int) -> None:
        """Draws (and with k >= 1 starts) every step up to ``min(step + k, last_step)``.

        Called at the start of step ``step``, once the weights of ``weights_step`` (``step -
        1``) serve: a rollout started now trains at most k steps later. A step after ``step``
        whose groups would take the running groups past ``max_buffered_groups`` is not drawn
        yet (nor any later one): a later call launches it.
        """
        while self._next <= min(step + self.max_staleness, self.last_step):
            cap = self.max_buffered_groups
            if (
                self._next > step
                and cap is not None
                and self.running_groups + self.groups_per_step > cap
            ):
                break
            tasks = next(self.stream)
            item = Launched(
                step=self._next,
                tasks=tasks,
                data_state=self.stream.get_state(),
                weights_step=weights_step,
            )
            if self.rollout is not None and self.max_staleness > 0:
                item.future = self.runner.submit(self.rollout(tasks, item.step))
                item.launched_at = time.perf_counter()
            self._queue.append(item)
            self._next += 1

    def take(self, step: int) -> tuple[Launched, Any]:
        """Step ``step``'s rollout result (waiting for it; k = 0 runs it now)."""
        item = self._queue.popleft()
        if item.step != step:
            raise RuntimeError(f"RolloutProducer: step {step} asked, step {item.step} queued")
        if self.rollout is None:
            return item, None
        if item.future is None:
            item.launched_at = time.perf_counter()
            raw = self.runner.run(self.rollout(item.tasks, item.step))
        else:
            raw = item.future.result()
        item.finished_at = time.perf_counter()
        return item, raw

    def skip(self, step: int) -> Launched:
        """Step ``step``'s drawn tasks on a process that does not roll out."""
        item, _ = self.take(step)
        return item

    def close(self) -> None:
        """Cancels the rollouts still running (their sandboxes are closed) and forgets them."""
        pending = [x.future for x in self._queue if x.future is not None and not x.future.done()]
        self._queue.clear()
        if pending and isinstance(self.runner, LoopThread):
            for f in pending:
                f.cancel()
            self.runner.cancel_all()
