"""What the engine reads from a checkpoint directory besides the weights.

The tokenizer (``tokenizer.json``), the EOS ids (``config.json`` and ``generation_config.json``,
as SGLang merges them) and, for a Qwen3-VL checkpoint, the image processor
(``preprocessor_config.json``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from osworld_jax.contract.errors import EngineError


def load_tokenizer(path: Path) -> Any:
    """``path/tokenizer.json`` as a ``tokenizers.Tokenizer`` (EngineError naming the file)."""
    from tokenizers import Tokenizer

    file = path / "tokenizer.json"
    if not file.exists():
        raise EngineError(
            f"{path}: no tokenizer.json (the embedded server decodes with it; serve token ids "
            "only with --skip-tokenizer-init)"
        )
    return Tokenizer.from_file(str(file))


def load_processor(path: Path, config: Any) -> Any:
    """The `ImageProcessor` of a Qwen3-VL checkpoint (None for a text model)."""
    from osworld_jax.model import ImageProcessor, Qwen3VLMoeConfig
    from osworld_jax.model.errors import ModelConfigError

    if not isinstance(config, Qwen3VLMoeConfig):
        return None
    try:
        return ImageProcessor.from_pretrained(path)
    except ModelConfigError as e:
        raise EngineError(
            f"{path}: a qwen3_vl_moe checkpoint needs its image processor: {e}"
        ) from None


def eos_ids(path: Path, config: Any) -> list[int]:
    """EOS ids of ``config.json`` and ``generation_config.json`` together, sorted."""
    ids: set[int] = set()
    for value in (config.eos_token_id,):
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    gen = path / "generation_config.json"
    if gen.exists():
        value = json.loads(gen.read_text()).get("eos_token_id")
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return sorted(int(i) for i in ids)
