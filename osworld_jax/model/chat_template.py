"""A model's chat template, rendered as HF ``transformers`` renders it (no jax, no tokenizer).

The model's own ``chat_template`` (``tokenizer_config.json``, ``chat_template.jinja`` or a
processor's ``chat_template.json``) is rendered
with jinja2 in an immutable sandbox, with the same environment HF ``transformers`` uses
(``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, ``raise_exception``, ``tojson``,
``strftime_now``), so a prompt renders exactly as ``apply_chat_template(..., tokenize=False)``
would. A template from an untrusted checkpoint cannot reach Python objects (the sandbox), cannot
build a string or list of more than `MAX_REPEAT` items with ``*`` in one step, and
``render(timeout_s=...)`` stops it at a deadline (a trace on the template's own frames: loops of
any depth, e.g. two nested ``range(100000)``, fail with `ChatTemplateError`). A built-in
Qwen-style (ChatML) template serves models without one. The agent room renders
its prompts with it (`osworld_jax.agent.tokenizer.AgentTokenizer`), the embedded server its
``/v1/chat/completions`` messages (`osworld_jax.server.openai_api`).
"""

from __future__ import annotations

import datetime
import json
import sys
import time
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


#: Most items ``*`` may produce in a template (``'x' * 10**10`` would allocate 10 GB at once).
MAX_REPEAT = 1 << 24


class _Sandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """HF's sandbox, plus a size check on ``*`` and ``**``."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(n, int):
                    if len(seq) * n > MAX_REPEAT:
                        raise jinja2.sandbox.SecurityError(
                            f"'*' would build {len(seq) * n} items, more than {MAX_REPEAT}"
                        )
        if operator == "**" and isinstance(right, int) and abs(right) > 1024:
            raise jinja2.sandbox.SecurityError(f"'**' with an exponent of {right}")
        return super().call_binop(context, operator, left, right)


class _Deadline:
    """A ``sys.settrace`` hook that raises in the template's own frames past a deadline."""

    def __init__(self, timeout_s: float, name: str) -> None:
        self.end, self.timeout_s, self.name = time.monotonic() + timeout_s, timeout_s, name

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != "<template>":
            return None  # no line events outside the template's code
        self.check()
        return self.line

    def line(self, frame: Any, event: str, arg: Any) -> Any:
        self.check()
        return self.line

    def check(self) -> None:
        if time.monotonic() > self.end:
            raise ChatTemplateError(
                f"{self.name}: rendering took more than {self.timeout_s} s (stopped)"
            )


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
        env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
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
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool,
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> str:
        """Renders ``messages`` (dicts with ``role`` and ``content``) to text.

        Args:
          messages: the conversation.
          add_generation_prompt: end with the assistant's turn header.
          timeout_s: stop rendering after this long (`ChatTemplateError`); it traces the
            calling thread meanwhile, so run it in a thread of its own (a server does).
          **kwargs: further template variables (``tools``, ``enable_thinking``, ...).

        Raises:
          ChatTemplateError: the template failed (any error of its code), was refused by the
            sandbox, or ran past ``timeout_s``.
        """
        ctx = {**self.special_tokens, **kwargs}
        previous = sys.gettrace()
        if timeout_s is not None:
            sys.settrace(_Deadline(timeout_s, self.name))
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **ctx,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{self.name}: rendering failed: {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise ChatTemplateError(
                f"{self.name}: rendering failed: {type(e).__name__}: {e}"
            ) from e
        except (RecursionError, OverflowError, MemoryError) as e:
            raise ChatTemplateError(f"{self.name}: rendering failed: {type(e).__name__}") from e
        finally:
            if timeout_s is not None:
                sys.settrace(previous)
