"""SGLang's routed-experts wire encoding (``meta_info.routed_experts``), for both sides.

The server encodes the experts its forward chose; the client decodes and validates them against
the reply's token counts before the trainer replays them (R3).
"""

from __future__ import annotations

import base64
import binascii

import numpy as np

from osworld_jax.contract.errors import ReplyValidationError


def encode_routed_experts(routes: np.ndarray) -> str:
    """Base64 of little-endian int32 (SGLang's ``meta_info.routed_experts`` encoding)."""
    return base64.b64encode(np.ascontiguousarray(routes, dtype="<i4").tobytes()).decode("ascii")


def decode_routed_experts(
    data: str, *, rows: int, num_layers: int, top_k: int, rid: str
) -> np.ndarray:
    """Decodes ``meta_info.routed_experts`` to i32 ``[rows, num_layers, top_k]``.

    ``rows`` is ``prompt_tokens + completion_tokens - 1 - routed_experts_start_len``; any other
    size (the classic off-by-one on the last token, or routes over-counted across turns) raises
    `ReplyValidationError` naming the request.
    """
    if not isinstance(data, str):
        raise ReplyValidationError(rid, f"routed_experts is {type(data).__name__}, not base64 str")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ReplyValidationError(rid, f"routed_experts is not valid base64: {e}") from None
    if len(raw) % 4:
        raise ReplyValidationError(rid, f"routed_experts has {len(raw)} bytes, not int32s")
    flat = np.frombuffer(raw, dtype="<i4")
    per_row = num_layers * top_k
    if rows < 0 or flat.size != rows * per_row:
        got = flat.size / per_row if per_row else float("nan")
        raise ReplyValidationError(
            rid,
            f"routed_experts has {got:g} rows of [{num_layers}, {top_k}], expected {rows} "
            "(prompt_tokens + completion_tokens - 1 - routed_experts_start_len)",
        )
    out = flat.astype(np.int32).reshape(rows, num_layers, top_k)
    if out.size and out.min() < -1:
        raise ReplyValidationError(rid, f"routed_experts holds invalid expert id {out.min()}")
    return out
