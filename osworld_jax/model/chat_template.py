"""A model's chat template, rendered as HF ``transformers`` renders it (no jax, no tokenizer).

The model's own ``chat_template`` (``tokenizer_config.json``, ``chat_template.jinja`` or a
processor's ``chat_template.json``) is rendered
with jinja2 in an immutable sandbox, with the same environment HF ``transformers`` uses
(``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, ``raise_exception``, ``tojson``,
``strftime_now``), so a prompt renders exactly as ``apply_chat_template(..., tokenize=False)``
would. A built-in Qwen-style (ChatML) template serves models without one. The agent room renders
its prompts with it (`osworld_jax.agent.tokenizer.AgentTokenizer`), the embedded server its
``/v1/chat/completions`` messages (`osworld_jax.server.openai_api`).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from osworld_jax.model.errors import ChatTemplateError

#: ChatML, as the Qwen2.5 / Qwen3 (non-thinking) templates render plain string messages.
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

Message = Mapping[str, Any]


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, **kw)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _token_content(value: Any) -> str | None:
    """A special token entry of ``tokenizer_config.json`` (string or AddedToken dict) as text."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


class ChatTemplate:
    """A compiled jinja2 chat template.

    Attributes:
      source: the template text.
      name: where it came from (a path or ``"builtin-qwen"``), used in error messages.
      special_tokens: ``bos_token``/``eos_token``/... values passed to the template.
    """

    def __init__(
        self,
        source: str,
        *,
        name: str = "chat_template",
        special_tokens: Mapping[str, str] | None = None,
    ) -> None:
        self.source = source
        self.name = name
        self.special_tokens = dict(special_tokens or {})
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{name}: the chat template does not compile: {e}") from e

    @classmethod
    def builtin_qwen(cls) -> ChatTemplate:
        """The built-in Qwen-style (ChatML) template."""
        return cls(
            QWEN_CHAT_TEMPLATE,
            name="builtin-qwen",
            special_tokens={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        )

    @classmethod
    def from_model_dir(cls, path: str | Path, *, allow_builtin: bool = True) -> ChatTemplate:
        """The template of a HF model directory.

        Looks at ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named
        templates of which ``default`` is taken), then ``chat_template.jinja``, then the
        processor file ``chat_template.json`` (``{"chat_template": ...}``, as Qwen-VL models
        ship it); falls back to the built-in Qwen template when ``allow_builtin`` (else raises
        ``ChatTemplateError``).
        """
        path = Path(path)
        cfg_path = path / "tokenizer_config.json"
        cfg: dict[str, Any] = {}
        if cfg_path.exists():
            try:
                cfg = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as e:
                raise ChatTemplateError(f"{cfg_path}: not valid JSON: {e}") from e
        special = {
            k: v
            for k in ("bos_token", "eos_token", "pad_token", "unk_token")
            if (v := _token_content(cfg.get(k))) is not None
        }
        source = cfg.get("chat_template")
        name = f"{cfg_path}:chat_template"
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
            source = named.get("default")
            name += "[default]"
        if not isinstance(source, str) and (path / "chat_template.jinja").exists():
            source = (path / "chat_template.jinja").read_text()
            name = str(path / "chat_template.jinja")
        if not isinstance(source, str) and (path / "chat_template.json").exists():
            json_path = path / "chat_template.json"
            try:
                source = json.loads(json_path.read_text()).get("chat_template")
            except (json.JSONDecodeError, AttributeError) as e:
                raise ChatTemplateError(f"{json_path}: not a JSON object: {e}") from e
            name = f"{json_path}:chat_template"
        if not isinstance(source, str):
            if not allow_builtin:
                raise ChatTemplateError(f"{path}: no chat_template in tokenizer_config.json")
            builtin = cls.builtin_qwen()
            builtin.special_tokens.update(special)
            return builtin
        return cls(source, name=name, special_tokens=special)

    def render(
        self, messages: Sequence[Message], *, add_generation_prompt: bool, **kwargs: Any
    ) -> str:
        """Renders ``messages`` (dicts with ``role`` and ``content``) to text."""
        ctx = {**self.special_tokens, **kwargs}
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **ctx,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{self.name}: rendering failed: {e}") from e
