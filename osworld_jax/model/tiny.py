"""`make_tiny_checkpoint`: a random tiny Qwen3-MoE HF checkpoint + an offline tokenizer.

Pure numpy + ``tokenizers`` (no torch, no network): the weights are drawn with
``numpy.random.default_rng(seed)`` in a fixed order and written in the HF per-expert layout,
the tokenizer is a byte-level BPE trained on ``assets/tiny_corpus.txt`` (OSWorld task
instructions and agent action snippets) with the Qwen special tokens. Deterministic in
``seed``; HF transformers ``from_pretrained`` and SGLang load the result.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from osworld_jax.model.config import Qwen3MoeConfig
from osworld_jax.model.errors import ModelConfigError
from osworld_jax.model.hf_io import hf_tensors, write_hf_dir
from osworld_jax.model.params import param_specs

CORPUS = Path(__file__).parent / "assets" / "tiny_corpus.txt"

# Qwen's special tokens; ids 0..5 in this order (so the padding id 0 is <|endoftext|>).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
BPE_VOCAB_SIZE = 1024

# Qwen2.5-VL style template: string or [{"type": "text"|"image", ...}] contents.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' or 'image' in item %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'text' %}{{- item['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_TINY_DEFAULTS: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=(0,),
    rope_theta=1_000_000.0,
    max_position_embeddings=32768,
    initializer_range=0.02,
    router_aux_loss_coef=0.0,
)


def build_tokenizer():
    """The offline byte-level BPE tokenizer (a ``tokenizers.Tokenizer``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [ln for ln in CORPUS.read_text().splitlines() if not ln.startswith("# ")]
    tok.train_from_iterator(lines, trainer)
    return tok


def _tokenizer_files(out: Path, tok, model_max_length: int) -> dict[str, int]:
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t, i in ids.items()
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "split_special_tokens": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return ids


def tiny_config(vocab_size: int, eos_token_id: int, **overrides: Any) -> Qwen3MoeConfig:
    """The tiny architecture (hidden 64, 3 layers with layer 0 dense, 8 experts top-2)."""
    fields = {f.name for f in dataclasses.fields(Qwen3MoeConfig)}
    bad = sorted(set(overrides) - fields)
    if bad:
        raise ModelConfigError(f"make_tiny_checkpoint: unknown config overrides {bad}")
    values = {**_TINY_DEFAULTS, "vocab_size": vocab_size, "eos_token_id": eos_token_id}
    values |= overrides
    if "mlp_only_layers" in values:
        values["mlp_only_layers"] = tuple(values["mlp_only_layers"])
    return Qwen3MoeConfig(**values)


def random_params(config: Qwen3MoeConfig, seed: int) -> dict[str, dict[str, np.ndarray]]:
    """Float32 numpy parameters in the `Policy.params()` layout (normal(0, init range))."""
    rng = np.random.default_rng(seed)
    out: dict[str, dict[str, np.ndarray]] = {}
    for key, spec in param_specs(config).items():
        group, name = key.split(".")
        if spec.init == "ones":
            value = np.ones(spec.shape, np.float32)
        else:
            value = rng.normal(0.0, config.initializer_range, spec.shape).astype(np.float32)
        out.setdefault(group, {})[name] = value
    return out


def make_tiny_checkpoint(path: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Writes a random tiny Qwen3-MoE checkpoint + tokenizer into directory ``path``.

    Args:
      path: output directory (created; existing files of the same names are overwritten).
      seed: seeds the weights (the tokenizer is deterministic on its own).
      **overrides: `Qwen3MoeConfig` fields replacing the tiny defaults, e.g.
        ``num_hidden_layers=4``, ``tie_word_embeddings=True``, ``initializer_range=0.2``.

    Returns:
      ``path`` (holding config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
      generation_config.json).
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    n_tok = tok.get_vocab_size()
    vocab = -(-n_tok // 64) * 64  # padded like Qwen's (vocab_size >= tokenizer size)
    config = tiny_config(vocab, _special_id(tok, EOS_TOKEN), **overrides)
    if config.vocab_size < n_tok:
        raise ModelConfigError(
            f"make_tiny_checkpoint: vocab_size {config.vocab_size} < tokenizer size {n_tok}"
        )
    ids = _tokenizer_files(out, tok, config.max_position_embeddings)
    generation = {
        "eos_token_id": [ids[EOS_TOKEN], ids[PAD_TOKEN]],
        "pad_token_id": ids[PAD_TOKEN],
        "bos_token_id": ids[PAD_TOKEN],
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    params = random_params(config, seed)
    write_hf_dir(out, config, hf_tensors(params, config), torch_dtype="float32")
    return out


def _special_id(tok, token: str) -> int:
    i = tok.token_to_id(token)
    assert i is not None, token
    return int(i)
