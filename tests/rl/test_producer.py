"""`RolloutProducer` and `LoopThread`: how far ahead rollouts start, what the checkpoint's stream
position is, and that stopping cancels the rollouts in flight (their clean-up runs)."""

import asyncio
import threading

import pytest

from osworld_jax.rl.producer import LoopThread, RolloutProducer


class Stream:
    """A task stream: step i's tasks are ``[f"task{i}"]``; the state is the draw count."""

    def __init__(self):
        self.drawn = 0

    def __next__(self):
        self.drawn += 1
        return [f"task{self.drawn}"]

    def get_state(self):
        return {"drawn": self.drawn}


class Rollouts:
    """Rollout coroutines that record when they start and wait until released."""

    def __init__(self):
        self.started, self.cleaned, self.release = [], [], {}
        self.thread_ids = set()

    async def __call__(self, tasks, step):
        self.started.append(step)
        self.thread_ids.add(threading.get_ident())
        event = self.release.setdefault(step, asyncio.Event())
        try:
            await event.wait()
            return (step, tasks)
        finally:
            self.cleaned.append(step)


def test_synchronous_producer_runs_each_rollout_when_its_step_takes_it():
    stream, rollouts = Stream(), Rollouts()
    with asyncio.Runner() as runner:
        producer = RolloutProducer(
            stream, rollouts, runner, max_staleness=0, last_step=3, first_step=1
        )

        async def released(tasks, step):
            rollouts.release[step] = asyncio.Event()
            rollouts.release[step].set()
            return await rollouts(tasks, step)

        producer.rollout = released
        for step in (1, 2, 3):
            producer.launch_through(step, weights_step=step - 1)
            assert stream.drawn == step and rollouts.started == list(range(1, step))
            launched, raw = producer.take(step)
            assert raw == (step, [f"task{step}"])
            assert launched.data_state == {"drawn": step}
            assert rollouts.started == list(range(1, step + 1))
        producer.launch_through(4, weights_step=3)  # beyond the last step: nothing drawn
        assert stream.drawn == 3


def test_rollouts_start_at_most_k_steps_ahead_and_checkpoint_their_draw_position():
    stream, rollouts = Stream(), Rollouts()
    with LoopThread() as loop:
        producer = RolloutProducer(
            stream, rollouts, loop, max_staleness=2, last_step=4, first_step=1
        )
        producer.launch_through(1, weights_step=0)
        loop.run(asyncio.sleep(0.05))
        assert sorted(rollouts.started) == [1, 2, 3]  # steps 1 .. 1 + k, all on weights 0
        assert producer.in_flight == 3
        assert threading.get_ident() not in rollouts.thread_ids  # on the loop's own thread

        def release(step):
            loop._loop.call_soon_threadsafe(rollouts.release[step].set)

        release(1)
        launched, raw = producer.take(1)
        assert raw == (1, ["task1"]) and launched.weights_step == 0
        assert launched.data_state == {"drawn": 1}  # not 3: steps 2, 3 are redrawn on resume
        producer.launch_through(2, weights_step=1)  # step 4 = 2 + k, the last one
        loop.run(asyncio.sleep(0.05))
        assert sorted(rollouts.started) == [1, 2, 3, 4]
        with pytest.raises(RuntimeError, match="step 3 asked, step 2 queued"):
            producer.take(3)


def test_closing_cancels_the_rollouts_in_flight_and_runs_their_clean_up():
    stream, rollouts = Stream(), Rollouts()
    with LoopThread() as loop:
        producer = RolloutProducer(
            stream, rollouts, loop, max_staleness=1, last_step=5, first_step=1
        )
        with producer:
            producer.launch_through(1, weights_step=0)
            loop.run(asyncio.sleep(0.05))
            assert sorted(rollouts.started) == [1, 2]
        assert sorted(rollouts.cleaned) == [1, 2]  # both cancelled and unwound
        assert producer.in_flight == 0
    assert loop._loop.is_closed()


def test_loop_thread_close_unwinds_what_still_runs():
    cleaned = []

    async def forever():
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned.append(True)

    loop = LoopThread()
    loop.submit(forever())
    assert loop.run(asyncio.sleep(0, result=7)) == 7
    loop.close()
    assert cleaned == [True]
    loop.close()  # idempotent


def test_max_buffered_groups_stops_launching_ahead_but_never_the_current_step():
    # k = 3, 2 groups per step (B + e), at most 4 groups running: two rollouts at a time.
    stream, rollouts = Stream(), Rollouts()
    running, peak = [0], [0]

    async def counted(tasks, step):
        running[0] += 2
        peak[0] = max(peak[0], running[0])
        try:
            return await rollouts(tasks, step)
        finally:
            running[0] -= 2

    with LoopThread() as loop:
        producer = RolloutProducer(
            stream,
            counted,
            loop,
            max_staleness=3,
            last_step=5,
            first_step=1,
            groups_per_step=2,
            max_buffered_groups=4,
        )

        def release(step):
            loop._loop.call_soon_threadsafe(rollouts.release[step].set)

        producer.launch_through(1, weights_step=0)
        loop.run(asyncio.sleep(0.05))
        assert sorted(rollouts.started) == [1, 2]  # step 3 would make 6 groups
        assert stream.drawn == 2 and producer.running_groups == 4
        release(1)
        launched, raw = producer.take(1)
        assert launched.data_state == {"drawn": 1}
        producer.launch_through(2, weights_step=1)  # 2 running + 2: step 3 fits, step 4 not
        loop.run(asyncio.sleep(0.05))
        assert sorted(rollouts.started) == [1, 2, 3] and stream.drawn == 3
        release(3)  # finished, not taken: no longer running
        loop.run(asyncio.sleep(0.05))
        release(2)
        producer.take(2)
        producer.launch_through(3, weights_step=2)
        loop.run(asyncio.sleep(0.05))
        assert sorted(rollouts.started) == [1, 2, 3, 4, 5]  # 3 done: 4 and 5 fit
        assert peak[0] == 4
        producer.close()

    # A cap of one step's groups still launches the current step (k ahead launches nothing).
    stream, rollouts = Stream(), Rollouts()
    with LoopThread() as loop:
        producer = RolloutProducer(
            stream,
            rollouts,
            loop,
            max_staleness=2,
            last_step=3,
            first_step=1,
            groups_per_step=2,
            max_buffered_groups=2,
        )
        producer.launch_through(1, weights_step=0)
        loop.run(asyncio.sleep(0.05))
        assert rollouts.started == [1] and stream.drawn == 1
        producer.close()
