"""Chat templates: built-in ChatML, the model's own template, sandboxing, parity with HF."""

from __future__ import annotations

import json

import numpy as np
import pytest

from osworld_jax.agent import AgentTokenizer, ChatTemplate, ChatTemplateError

from .conftest import write_model_dir

MSGS = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U1"},
    {"role": "assistant", "content": "A1"},
    {"role": "user", "content": "U2"},
]

# A Qwen3-style template: drops <think> of assistant turns before the last user query, opens the
# last assistant turn with an empty think block, and uses raise_exception / tojson.
QWEN3_LIKE = """\
{%- if messages[0].role != 'system' %}{{ raise_exception('first message must be system') }}\
{%- endif %}
{%- set ns = namespace(last_query=0) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}\
{%- endif %}{%- endfor %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}
{%- set content = m.content.split('</think>')[-1].lstrip('\\n') %}
{%- if loop.index0 > ns.last_query %}
{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
{%- endif %}
{%- else %}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if tools %}{{ tools | tojson }}{%- endif %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def test_builtin_qwen_renders_chatml():
    text = ChatTemplate.builtin_qwen().render(MSGS, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n"
        "<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_gen = ChatTemplate.builtin_qwen().render(MSGS, add_generation_prompt=False)
    assert no_gen == text[: -len("<|im_start|>assistant\n")]


def test_model_dir_template_is_used(tmp_path, raw_tokenizer):
    d = write_model_dir(
        tmp_path / "m",
        raw_tokenizer,
        chat_template="{{ eos_token }}|{{ messages"
        "[0]['content'] }}{% if add_generation_prompt %}>{% endif %}",
    )
    tok = AgentTokenizer.from_model_dir(d)
    assert tok.template.render(MSGS, add_generation_prompt=True) == "<|im_end|>|S>"
    # Special token strings in text map to their ids; no BOS is added.
    ids = tok.encode("<|im_start|>x<|im_end|>")
    assert ids[0] == tok.token_id("<|im_start|>") and ids[-1] == tok.token_id("<|im_end|>")
    assert ids.dtype == np.int32


def test_named_template_list_and_jinja_file_and_builtin_fallback(tmp_path, raw_tokenizer):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    d1 = write_model_dir(tmp_path / "a", raw_tokenizer, chat_template=named)
    assert ChatTemplate.from_model_dir(d1).render(MSGS, add_generation_prompt=False) == "D"
    d2 = write_model_dir(tmp_path / "b", raw_tokenizer)
    (d2 / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert ChatTemplate.from_model_dir(d2).render(MSGS, add_generation_prompt=False) == "J4"
    d3 = write_model_dir(tmp_path / "c", raw_tokenizer)
    assert ChatTemplate.from_model_dir(d3).name == "builtin-qwen"
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        ChatTemplate.from_model_dir(d3, allow_builtin=False)


def test_template_is_sandboxed_and_errors_are_clear(tmp_path):
    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}", name="evil")
    with pytest.raises(ChatTemplateError, match="evil: rendering failed"):
        evil.render(MSGS, add_generation_prompt=False)
    with pytest.raises(ChatTemplateError, match="first message must be system"):
        ChatTemplate(QWEN3_LIKE).render(MSGS[1:], add_generation_prompt=True)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}", name="broken")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ChatTemplateError, match="not valid JSON"):
        ChatTemplate.from_model_dir(bad)


def test_rendering_matches_hf_apply_chat_template(tmp_path):
    # The tiny checkpoint's own template (model room) and a Qwen3-style one render exactly as
    # transformers' apply_chat_template(tokenize=False) does.
    import transformers

    from osworld_jax.model.tiny import make_tiny_checkpoint

    tiny = make_tiny_checkpoint(tmp_path / "tiny")
    q3 = tmp_path / "q3"
    q3.mkdir()
    for f in ("tokenizer.json",):
        (q3 / f).write_bytes((tiny / f).read_bytes())
    cfg = json.loads((tiny / "tokenizer_config.json").read_text())
    cfg["chat_template"] = QWEN3_LIKE
    (q3 / "tokenizer_config.json").write_text(json.dumps(cfg))
    convs = [
        MSGS,
        MSGS[:2],
        [*MSGS, {"role": "assistant", "content": "<think>plan</think>\n\nA2"}],
    ]
    for d in (tiny, q3):
        ours = AgentTokenizer.from_model_dir(d)
        hf = transformers.AutoTokenizer.from_pretrained(str(d))
        for msgs in convs:
            for gen in (True, False):
                want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
                assert ours.template.render(msgs, add_generation_prompt=gen) == want
                assert ours.encode(want).tolist() == hf.encode(want, add_special_tokens=False)
