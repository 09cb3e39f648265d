"""Device memory of a run from its compiled programs: what XLA will allocate, per pool.

The analytic estimate (`osworld_jax.trainer.memory`) guesses a step's activations from
coefficients; XLA knows them once it has compiled the program. This module asks it:
``jit(f).lower(*abstract_args).compile().memory_analysis()`` gives, per device, the sizes of the
program's arguments, outputs, the outputs that alias (donated) arguments, its temporaries and
its generated code. No weight is needed: the arguments are ``jax.ShapeDtypeStruct`` with the
run's shardings. A program's peak is

    peak = arguments + outputs - aliased + temp + code

and its *transient* part is what it adds beyond the long-lived buffers among its arguments
(``persistent``: the train state, the server's weights and KV cache): ``peak - persistent``.

A `Pool` is one allocator (one process's share of a device, or one jax client shared by the
trainer and an in-process server). Its long-lived buffers are counted once; its programs belong
to *streams* (the trainer's, the server's engine thread): the programs of one stream run one
after another, so a stream needs its largest transient; streams that may run at the same time
(``concurrent``: an in-process server while the step trains, ``max_staleness >= 1``) add up,
otherwise the largest stream counts::

    need = sum(persistent) + reserve + (sum | max over streams)(max transient of the stream)

``reserve`` is what XLA allocates from the pool outside the programs' buffers: the autotuner's
candidate buffers when a program compiles in a full pool. The plan compiles every program
before the pool's long-lived buffers exist, and with ``RLConfig.compilation_cache_dir`` the run
loads those executables (tuned) instead of compiling them again, so nothing autotunes mid-run;
``AUTOTUNE_RESERVE`` covers the programs outside the plan (small utility jits, the top-logprob
variants of the server's buckets). cuDNN's and cuBLAS's workspaces are outputs of their custom
calls: XLA counts them in ``temp``.

A plan that does not fit is refused in one line naming the pool, the program that binds, its
peak and the knob that fixes it (`MemoryPlan.check`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

from osworld_jax.errors import ConfigError

GiB = float(1 << 30)
#: Bytes a GPU pool keeps free for programs compiled outside the plan (their autotuning).
AUTOTUNE_RESERVE = 1 << 30


class MemoryPlanError(ConfigError):
    """The run's programs do not fit their pool (one line: pool, program, peak, knob)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProgramMemory:
    """One compiled program's per-device memory (bytes, from ``memory_analysis()``).

    Attributes:
      name: the program and its shape, e.g. ``"train_step 8x1024"``.
      stream: the programs of one stream run one at a time (``"trainer"``, ``"server"``).
      arguments: its arguments (the long-lived ones included).
      outputs: its outputs.
      aliased: outputs written into donated arguments (not allocated again).
      temp: its temporaries (activations, workspaces).
      code: its generated code.
      persistent: the long-lived buffers among its arguments (counted once by the pool).
      knob: what lowers its transient (one phrase, for the refusal).
    """

    name: str
    stream: str
    arguments: int
    outputs: int
    aliased: int
    temp: int
    code: int
    persistent: int = 0
    knob: str = ""

    @property
    def peak(self) -> int:
        """``arguments + outputs - aliased + temp + code``: its bytes while it runs."""
        return self.arguments + self.outputs - self.aliased + self.temp + self.code

    @property
    def transient(self) -> int:
        """What it needs beyond the pool's long-lived buffers: ``peak - persistent``."""
        return self.peak - self.persistent


def program_memory(
    name: str, compiled: Any, *, stream: str, persistent: int = 0, knob: str = ""
) -> ProgramMemory:
    """The `ProgramMemory` of a ``jax.stages.Compiled`` (its ``memory_analysis()``)."""
    m = compiled.memory_analysis()
    if m is None:  # a backend without the analysis
        raise MemoryPlanError(f"{name}: the backend reports no memory analysis of its program")
    return ProgramMemory(
        name=name,
        stream=stream,
        arguments=int(m.argument_size_in_bytes),
        outputs=int(m.output_size_in_bytes),
        aliased=int(m.alias_size_in_bytes),
        temp=int(m.temp_size_in_bytes),
        code=int(m.generated_code_size_in_bytes),
        persistent=persistent,
        knob=knob,
    )


def device_bytes(tree: Any) -> int:
    """Per-device bytes of a pytree of arrays or ``ShapeDtypeStruct``s (one device's shards).

    A leaf without a sharding counts whole (one device).
    """
    total = 0
    for x in jax.tree.leaves(tree):
        shape = tuple(x.shape)
        sharding = getattr(x, "sharding", None)
        if sharding is not None:
            shape = tuple(sharding.shard_shape(shape))
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pool:
    """One allocator's long-lived buffers and programs (module doc).

    Attributes:
      name: e.g. ``"trainer"``, ``"server"``, ``"trainer + server"`` (one jax client).
      capacity: its bytes per device (None: unknown, nothing to check).
      persistent: ``(name, bytes)`` of its long-lived buffers, each counted once.
      programs: its programs (each in a stream).
      concurrent: its streams may run at the same time (their transients add up).
      reserve: bytes kept free beside the programs (`AUTOTUNE_RESERVE` on a GPU).
      capacity_knob: what gives the pool more memory (for the refusal).
    """

    name: str
    capacity: float | None
    persistent: tuple[tuple[str, int], ...]
    programs: tuple[ProgramMemory, ...]
    concurrent: bool = False
    reserve: int = 0
    capacity_knob: str = ""

    def stream_peaks(self) -> dict[str, ProgramMemory]:
        """The largest-transient program of each stream."""
        out: dict[str, ProgramMemory] = {}
        for p in self.programs:
            if p.stream not in out or p.transient > out[p.stream].transient:
                out[p.stream] = p
        return out

    @property
    def persistent_bytes(self) -> int:
        """The long-lived buffers, once each."""
        return sum(b for _, b in self.persistent)

    @property
    def need(self) -> int:
        """Bytes the pool needs per device (module doc)."""
        peaks = [p.transient for p in self.stream_peaks().values()]
        programs = (sum(peaks) if self.concurrent else max(peaks, default=0)) if peaks else 0
        return self.persistent_bytes + self.reserve + max(programs, 0)

    def binding(self) -> ProgramMemory | None:
        """The program whose transient is the largest (the one to shrink first)."""
        return max(self.programs, key=lambda p: p.transient, default=None)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The run's pools; `check` refuses one that does not fit, `table` prints them."""

    pools: tuple[Pool, ...]

    def check(self) -> None:
        """Raises `MemoryPlanError` (one line) for the first pool over its capacity."""
        for pool in self.pools:
            if pool.capacity is None or pool.need <= pool.capacity:
                continue
            worst = pool.binding()
            what = ""
            if worst is not None:
                what = (
                    f": {worst.name} peaks at {_gib(worst.peak)} GiB ({_gib(worst.transient)} "
                    f"beyond the {_gib(pool.persistent_bytes)} GiB of "
                    f"{' + '.join(n for n, _ in pool.persistent) or 'long-lived buffers'})"
                )
            fixes = [k for k in ((worst.knob if worst else ""), pool.capacity_knob) if k]
            raise MemoryPlanError(
                f"memory plan: the {pool.name} pool needs {_gib(pool.need)} GiB of its "
                f"{_gib(pool.capacity)} GiB{what}; lower it with {' or '.join(fixes)}"
            )

    def table(self) -> list[str]:
        """A per-program table (GiB per device), then each pool's need against its capacity."""
        head = f"{'program':<34} {'pool':<16} {'args':>7} {'out':>7} {'alias':>7} "
        head += f"{'temp':>7} {'code':>6} {'peak':>7}"
        lines = [head]
        for pool in self.pools:
            for p in pool.programs:
                sizes = (p.arguments, p.outputs, p.aliased, p.temp)
                cells = " ".join(f"{_gib(b):>7}" for b in sizes)
                lines.append(
                    f"{p.name:<34} {pool.name:<16} {cells} {_gib(p.code):>6} {_gib(p.peak):>7}"
                )
        for pool in self.pools:
            cap = "unknown" if pool.capacity is None else f"{_gib(pool.capacity)} GiB"
            rule = "streams concurrent" if pool.concurrent else "one program at a time"
            kept = ", ".join(f"{n} {_gib(b)}" for n, b in pool.persistent)
            lines.append(
                f"pool {pool.name}: needs {_gib(pool.need)} GiB of {cap} ({kept}; reserve "
                f"{_gib(pool.reserve)}; {rule})"
            )
        return lines


def _gib(b: float) -> str:
    return f"{b / GiB:.2f}"


# ---------------------------------------------------------------------- the trainer's programs


def abstract_batch(
    model: Any,
    rows: int,
    seq: int,
    *,
    patches: int = 0,
    image_slots: int = 1,
    routes: bool = True,
) -> Any:
    """A device `Batch` of ``ShapeDtypeStruct``s (no shardings yet), as the trainer uploads it.

    ``patches``: per-row image patches (0: a text batch; a Qwen3-VL model's positions are the
    M-RoPE [3, R, T] either way). ``routes``: R3 on (the routes are uploaded).
    """
    from osworld_jax.batch import Batch, route_dtype

    def sds(shape: tuple[int, ...], dtype: Any) -> Any:  # a Batch field's stand-in
        return jax.ShapeDtypeStruct(shape, np.dtype(dtype))

    vision = getattr(model, "vision", None)
    rt = (rows, seq)
    positions = sds((3, *rt) if vision is not None else rt, np.int32)
    routed = None
    if routes:
        shape = (*rt, model.num_hidden_layers, model.num_experts_per_tok)
        routed = sds(shape, route_dtype(model.num_experts))
    pixels = grid = None
    if patches:
        if vision is None:
            raise ConfigError("abstract_batch: image patches for a text model")
        pixels = sds((rows, patches, vision.patch_dim), np.float32)
        grid = sds((rows, image_slots, 3), np.int32)
    return Batch(
        tokens=sds(rt, np.int32),
        loss_mask=sds(rt, np.float32),
        behavior_logprobs=sds(rt, np.float32),
        advantages=sds(rt, np.float32),
        positions=positions,
        segment_ids=sds(rt, np.int32),
        owner_ids=sds((rows,), np.int32),
        group_ids=sds((rows,), np.int32),
        row_weight=sds((rows,), np.float32),
        routed_experts=routed,  # type: ignore[arg-type]  # None: R3 off (uploaded so)
        pixel_values=pixels,
        image_grid_thw=grid,
    )


#: What lowers a train-side program's transient (the refusal's knob).
TRAIN_KNOB = (
    "RLConfig.length_buckets (shorter rows), TrainerConfig.num_micro_batches, "
    "ModelRuntimeConfig.remat / vision_remat, or OptimizerConfig.freeze_vision"
)


def trainer_programs(
    trainer: Any,
    *,
    rows: int,
    lengths: Sequence[int],
    patch_buckets: Sequence[int] = (),
    image_slots: int = 1,
) -> list[ProgramMemory]:
    """The compiled train step (and the old-logprob pass) at every length x patch bucket.

    Compiles through the trainer's own jitted functions (`Trainer.lower`: the same shardings
    and donation as its step), so with a persistent compilation cache the run's first step of
    each shape loads the executable compiled here. The train state (params, masters, moments)
    is the persistent part; ``Trainer.logprobs`` (``num_minibatches > 1``) takes the parameters.

    Args:
      trainer: the run's `Trainer`.
      rows: batch rows of a step (its row bucket).
      lengths: the padded row lengths a step may take (``RLConfig.length_buckets``).
      patch_buckets: per-row patch counts a VL step may take (empty: text steps only).
      image_slots: image slots per row (``image_grid_thw``'s m).
    """
    state = device_bytes(trainer.abstract_state)
    params = device_bytes(trainer.abstract_state.params)
    minibatches = trainer.config.num_minibatches > 1
    routes = trainer.config.router_replay
    out = []
    for seq in lengths:
        for patches in tuple(patch_buckets) or (0,):
            batch = abstract_batch(
                trainer.model, rows, seq, patches=patches, image_slots=image_slots, routes=routes
            )
            shape = f"{rows}x{seq}" + (f" {patches}p" if patches else "")
            step = trainer.lower("train_step", batch, old_logprobs=minibatches).compile()
            out.append(
                program_memory(
                    f"train_step {shape}", step, stream="trainer", persistent=state, knob=TRAIN_KNOB
                )
            )
            if minibatches:
                lp = trainer.lower("logprobs", batch).compile()
                out.append(
                    program_memory(
                        f"logprobs {shape}",
                        lp,
                        stream="trainer",
                        persistent=params,
                        knob=TRAIN_KNOB,
                    )  # fmt: skip
                )
    return out


def trainer_pool(
    trainer: Any,
    programs: Iterable[ProgramMemory],
    *,
    capacity: float | None,
    reserve: int = 0,
    capacity_knob: str = "",
) -> Pool:
    """The trainer's own pool: the train state once, its programs one at a time."""
    return Pool(
        name="trainer",
        capacity=capacity,
        persistent=(("train state", device_bytes(trainer.abstract_state)),),
        programs=tuple(programs),
        reserve=reserve,
        capacity_knob=capacity_knob,
    )


def colocated_pool(trainer: Pool, server: Pool, *, capacity: float | None, overlap: bool) -> Pool:
    """One jax client for the trainer and an in-process server: their buffers add up.

    ``overlap``: rollouts run while the step trains (``max_staleness >= 1``), so a train-step
    temporary and a prefill temporary may be live at once (the streams are concurrent).
    """
    return Pool(
        name="trainer + server",
        capacity=capacity,
        persistent=trainer.persistent + server.persistent,
        programs=trainer.programs + server.programs,
        concurrent=overlap,
        reserve=max(trainer.reserve, server.reserve),
        capacity_knob=trainer.capacity_knob or server.capacity_knob,
    )
