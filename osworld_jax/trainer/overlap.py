"""Communication/compute overlap of the sharded train step: XLA:GPU flag presets.

The step's collectives are inserted by XLA's SPMD partitioner after autodiff: FSDP all-gathers
of the parameters sharded over ``fsdp`` (forward and again in the backward), reduce-scatters of
their gradients, all-reduces of the gradients of parameters replicated over batch axes, and the
expert-parallel token all-gathers / reduce-scatters (`osworld_jax.model.expert_parallel`).
Inside the layer scan (a while loop) iteration ``i`` gathers layer ``i``'s weights right before
their first matmul; unless XLA moves them, the GPU waits for each one. What each flag does:

- ``--xla_gpu_enable_latency_hiding_scheduler``: schedules every asynchronous collective's
  start as early and its completion as late as its data dependencies allow, so it overlaps
  independent compute of the same computation (e.g. the next attention weights' gather with
  the current MoE GEMMs of one iteration, or the token all-gather with the router).
- ``--xla_gpu_enable_pipelined_all_gather`` / ``_reduce_scatter`` / ``_all_reduce`` (XLA's
  collective pipeliner): rewrites the scan's while loop so iteration ``i`` issues the
  all-gather of layer ``i + 1``'s parameters (a prefetch one layer ahead) and the
  reduce-scatter / all-reduce of layer ``i - 1``'s gradients, so each overlaps a whole layer
  of compute.
- ``--xla_gpu_enable_while_loop_double_buffering`` (unroll the loop by two so the pipelined
  buffers alternate) is in **no preset**: with jax 0.11.2 on 2 H200s it alone changed the
  step's result (bench-moe, expert=2, 8 rows: first-step grad norm 0.036 against 1.055 on one
  GPU and on 2 GPUs without it; benchmarks/NOTES.md, issue 22).
- ``--xla_gpu_{all_gather,reduce_scatter,all_reduce}_combine_threshold_bytes``: merges the
  collectives of one layer's parameters (q, k, v, o, router, ...) into one larger transfer
  (fewer NCCL launches, better link use) up to that size.
- ``--xla_gpu_threshold_for_windowed_einsum_mib`` (collective matmul, "windowed einsum"): a
  matmul whose sharded operand must first be all-gathered (or whose output is then
  reduce-scattered) becomes a loop of partial matmuls and collective-permutes that overlap
  each other (``--xla_gpu_multi_streamed_windowed_einsum`` runs them on separate streams).
  The SPMD partitioner picks the matmuls it can decompose (designed for tensor parallelism:
  the ``tensor`` axis); 0 MiB lets every size qualify.

An explicit prefetch written in the scan (layer ``i + 1``'s gathered weights carried into
iteration ``i + 1``) is not offered: a scan carry is saved for the backward, so every layer's
gathered (unsharded) weights would stay in memory and FSDP would save nothing. The collective
pipeliner makes the same schedule on the HLO after autodiff, where the backward re-gathers.

Measured (2 H200s, NVLink NV18, bench-moe on the 2-GPU preset): "pipelined" computes the same
step as "none" and is as fast (287.1 against 285.8 ms): with expert parallelism the exposed
communication is small. The mesh presets therefore keep "none"; the flags stay selectable
for meshes that gather more (``fsdp``), unmeasured there.

Presets (`OVERLAP_PRESETS`): ``"none"`` (XLA's defaults), ``"pipelined"`` (the scheduler, the
pipeliner for all three collectives, combine thresholds) and
``"collective_matmul"`` (``"pipelined"`` plus windowed einsums). XLA reads ``XLA_FLAGS`` once,
when the backend starts: `apply_overlap` must run before the first device use (it raises
afterwards rather than be silently ignored). The flags are XLA:GPU's; other backends parse
and ignore them (every name is checked against this jaxlib by the tests).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import MutableMapping

from osworld_jax.errors import ConfigError

MiB = 1 << 20

_PIPELINED = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    f"--xla_gpu_all_gather_combine_threshold_bytes={256 * MiB}",
    f"--xla_gpu_reduce_scatter_combine_threshold_bytes={128 * MiB}",
    f"--xla_gpu_all_reduce_combine_threshold_bytes={1024 * MiB}",
)

#: Preset name -> XLA flags (see the module docstring for each flag).
OVERLAP_PRESETS: dict[str, tuple[str, ...]] = {
    "none": (),
    "pipelined": _PIPELINED,
    "collective_matmul": _PIPELINED
    + (
        "--xla_gpu_threshold_for_windowed_einsum_mib=0",
        "--xla_gpu_multi_streamed_windowed_einsum=true",
    ),
}


def overlap_flags(preset: str) -> tuple[str, ...]:
    """The XLA flags of ``preset`` (`OVERLAP_PRESETS`); an unknown name raises `ConfigError`."""
    if preset not in OVERLAP_PRESETS:
        raise ConfigError(
            f"overlap preset {preset!r}: unknown; choose one of {sorted(OVERLAP_PRESETS)}"
        )
    return OVERLAP_PRESETS[preset]


def merged_xla_flags(current: str, flags: tuple[str, ...]) -> str:
    """``current`` XLA_FLAGS with ``flags`` added; a flag already set there keeps its value."""
    words = shlex.split(current)
    named = {w.split("=", 1)[0] for w in words}
    words += [f for f in flags if f.split("=", 1)[0] not in named]
    return " ".join(words)


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - jax moved it: no check
        return False
    return bool(xla_bridge.backends_are_initialized())


def apply_overlap(preset: str, environ: MutableMapping[str, str] | None = None) -> str:
    """Adds ``preset``'s flags to ``XLA_FLAGS`` (flags the user already set win).

    Args:
      preset: an `OVERLAP_PRESETS` name.
      environ: the environment to change (default ``os.environ``).

    Returns:
      The new ``XLA_FLAGS`` value.

    Raises:
      ConfigError: an unknown preset, or a non-empty preset after the JAX backend started (XLA
        would never read the flags).
    """
    flags = overlap_flags(preset)
    environ = os.environ if environ is None else environ
    current = environ.get("XLA_FLAGS", "")
    if not flags:
        return current
    merged = merged_xla_flags(current, flags)
    if merged != current and environ is os.environ and _backend_started():
        raise ConfigError(
            f"overlap preset {preset!r}: the JAX backend already started, XLA_FLAGS are read "
            "only at start-up; apply it before the first device use"
        )
    environ["XLA_FLAGS"] = merged
    return merged
