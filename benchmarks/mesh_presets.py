"""A mesh preset gin (``configs/mesh_*gpu.gin``) read as the benchmarks use it.

Shared by ``benchmarks/comm_volume.py`` (the predicted communication of each preset) and
``benchmarks/train_step.py --preset`` (a step on a preset's mesh), so neither imports the other.
"""

from __future__ import annotations

from pathlib import Path


def load_preset(path: Path) -> tuple[dict[str, int], object, str]:
    """``(mesh axes, ModelRuntimeConfig bindings applied to bench-moe's, overlap)`` of a gin."""
    from osworld_jax import config as gin_config
    from osworld_jax.model import ModelRuntimeConfig
    from osworld_jax.rl.config import MeshConfig

    gin_config.parse_gin([path])
    mesh = gin_config.build(MeshConfig)
    runtime = gin_config.build(ModelRuntimeConfig)
    return mesh.axes(), runtime, mesh.overlap
