"""Hand-written accelerator kernels behind the model's backend switches.

- `grouped_matmul`: grouped (per-expert) matmuls over a tile-aligned permutation of the routed
  rows, as Pallas kernels (Triton lowering on GPU, interpret mode on CPU), with dx and dw
  kernels under one ``custom_vjp``; `gmm_experts` is the ``"pallas_gmm"`` expert backend (its
  expert MLP is one ``custom_vjp`` with hand-chosen residuals, see ``_expert_mlp``).
"""

from osworld_jax.model.kernels.grouped_matmul import (
    GmmConfig,
    MosaicConfig,
    TilePlan,
    combine,
    dispatch,
    gmm,
    gmm_experts,
    tile_plan,
)

__all__ = [
    "GmmConfig",
    "MosaicConfig",
    "TilePlan",
    "combine",
    "dispatch",
    "gmm",
    "gmm_experts",
    "tile_plan",
]
