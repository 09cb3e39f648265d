"""The tokenizer the agent speaks through: a model's fast tokenizer, chat template, processor.

The chat template itself (`ChatTemplate`) lives in the model room
(`osworld_jax.model.chat_template`), beside the image processor, so the embedded server renders
``/v1/chat/completions`` with the same code.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tokenizers

from osworld_jax.model.chat_template import ChatTemplate
from osworld_jax.model.errors import ChatTemplateError
from osworld_jax.model.processor import PREPROCESSOR_FILE, ImageProcessor


class AgentTokenizer:
    """A ``tokenizers.Tokenizer``, the chat template and the image processor of one model.

    Encoding never adds special tokens of its own (no BOS): prompts are ids of rendered text.

    Attributes:
      tokenizer: the underlying fast tokenizer.
      template: the chat template.
      image_processor: the model's image processor (``preprocessor_config.json``; it alone
        decides how many image tokens a screenshot takes), or None for a text model.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        template: ChatTemplate,
        image_processor: ImageProcessor | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.image_processor = image_processor
        self._special = tuple(
            t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special
        )

    @classmethod
    def from_model_dir(cls, path: str | Path, *, allow_builtin: bool = True) -> AgentTokenizer:
        """Loads ``tokenizer.json``, the chat template and (when present) the image processor
        (``preprocessor_config.json``) of a HF model directory."""  # noqa: D205, D209
        path = Path(path)
        tok_path = path / "tokenizer.json"
        if not tok_path.exists():
            raise ChatTemplateError(f"{tok_path}: missing (a fast tokenizer file is required)")
        tok = tokenizers.Tokenizer.from_file(str(tok_path))
        processor = None
        if (path / PREPROCESSOR_FILE).is_file():
            processor = ImageProcessor.from_pretrained(path)
        template = ChatTemplate.from_model_dir(path, allow_builtin=allow_builtin)
        return cls(tok, template, processor)

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """The special token strings of the vocabulary."""
        return self._special

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` as i32[n] (special token strings map to their ids)."""
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        """The id of a single token string, or None when it is not in the vocabulary."""
        i = self.tokenizer.token_to_id(token)
        return None if i is None else int(i)

    def count(self, text: str) -> int:
        """Number of tokens of ``text``."""
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)
