"""Host-side validation of R3 replay routes (before they enter a jitted call)."""

from __future__ import annotations

import numpy as np

from osworld_jax.model.config import Qwen3MoeConfig
from osworld_jax.model.errors import RouterReplayError


def validate_replay(replay_experts: np.ndarray, config: Qwen3MoeConfig) -> None:
    """Raises `RouterReplayError` unless every [.., K] row is all -1 or K distinct valid ids.

    Args:
      replay_experts: int [B, S, L, K] (or any [..., L, K]) replayed expert ids; -1 = no route.
      config: the model config (L, K and E are checked against it).

    Raises:
      RouterReplayError: naming the first bad row's index and values, for rows that are partly
        negative, hold ids outside [0, E), or repeat an id; or for a wrong shape / dtype.
    """
    r = np.asarray(replay_experts)
    L, K, E = config.num_hidden_layers, config.num_experts_per_tok, config.num_experts
    if r.ndim < 2 or r.shape[-2:] != (L, K):
        raise RouterReplayError(f"replay_experts shape {r.shape}: expected [..., L={L}, K={K}]")
    if not np.issubdtype(r.dtype, np.integer):
        raise RouterReplayError(f"replay_experts dtype {r.dtype}: expected an integer dtype")
    live = np.all(r == -1, axis=-1)  # [..., L] rows that route live
    srt = np.sort(r, axis=-1)
    problems = {
        "negative ids in a row that is not all -1": np.any(r < 0, axis=-1) & ~live,
        f"expert id out of range [0, {E})": np.any(r >= E, axis=-1),
        "duplicate expert ids": np.any(srt[..., 1:] == srt[..., :-1], axis=-1) & ~live,
    }
    for what, bad in problems.items():
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            raise RouterReplayError(
                f"replay_experts{list(idx)} = {r[idx].tolist()}: {what} ({int(bad.sum())} bad rows)"
            )
