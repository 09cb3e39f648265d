"""`make_tiny_checkpoint`: a random tiny Qwen3-MoE / Qwen3-VL-MoE HF checkpoint + tokenizer.

Pure numpy + ``tokenizers`` (no torch, no network): the weights are drawn with
``numpy.random.default_rng(seed)`` in a fixed order and written in the HF layout, the
tokenizer is a byte-level BPE trained on ``assets/tiny_corpus.txt`` (OSWorld task
instructions and agent action snippets) with the Qwen special tokens. Deterministic in
``seed``; HF transformers ``from_pretrained`` and SGLang load the result.

``kind="qwen3_vl_moe"`` adds a tiny ViT (3 blocks, DeepStack after blocks 0 and 1), the vision
special tokens (``<|video_pad|>`` too), a ``preprocessor_config.json`` (Qwen3-VL's processor
with a smaller pixel budget: a 1920x1080 screenshot becomes 144 image tokens) and a chat
template of Qwen3-VL's shape that renders image / video content parts.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from osworld_jax.model.config import Qwen3MoeConfig
from osworld_jax.model.errors import ModelConfigError
from osworld_jax.model.hf_io import hf_tensors, write_hf_dir
from osworld_jax.model.params import param_specs
from osworld_jax.model.processor import QWEN3_VL_PREPROCESSOR, ImageProcessor
from osworld_jax.model.vl_config import Qwen3VLMoeConfig, VisionConfig

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

KINDS = ("qwen3_moe", "qwen3_vl_moe")
VL_SPECIAL_TOKENS = SPECIAL_TOKENS + ("<|video_pad|>",)

# Qwen3-VL's chat template shape: system / user / assistant / tool turns; user content parts of
# type image / video / text (``add_vision_id`` numbers them); assistant tool calls.
VL_CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) %}"
    "{%- set video_count = namespace(value=0) %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' or message['role'] == 'system' %}"
    "{{- '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for content in message['content'] %}"
    "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{%- set image_count.value = image_count.value + 1 %}"
    "{%- if add_vision_id %}{{- 'Picture ' ~ image_count.value ~ ': ' }}{%- endif %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif content['type'] == 'video' or 'video' in content %}"
    "{%- set video_count.value = video_count.value + 1 %}"
    "{%- if add_vision_id %}{{- 'Video ' ~ video_count.value ~ ': ' }}{%- endif %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in content %}{{- content['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] %}{%- for content in message['content'] %}"
    "{%- if 'text' in content %}{{- content['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- for tool_call in message.get('tool_calls') or [] %}"
    "{%- set call = tool_call['function'] if 'function' in tool_call else tool_call %}"
    "{{- '\n<tool_call>\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{{- (call['arguments'] if call['arguments'] is string else call['arguments'] | tojson) }}"
    "{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

_TINY_VISION: dict[str, Any] = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=64,
    deepstack_visual_indexes=(0, 1),
    initializer_range=0.02,
)
# The VL text tower: the text defaults with non-square fused experts (H = 64, I = 48).
_TINY_VL_TEXT: dict[str, Any] = dict(moe_intermediate_size=48)
# Qwen3-VL's processor with a CPU-sized pixel budget (64^2 .. 384^2 pixels).
_TINY_PREPROCESSOR: dict[str, Any] = {
    **QWEN3_VL_PREPROCESSOR,
    "size": {"shortest_edge": 64 * 64, "longest_edge": 384 * 384},
}

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


def build_tokenizer(special_tokens: tuple[str, ...] = SPECIAL_TOKENS):
    """The offline byte-level BPE tokenizer (a ``tokenizers.Tokenizer``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [ln for ln in CORPUS.read_text().splitlines() if not ln.startswith("# ")]
    tok.train_from_iterator(lines, trainer)
    return tok


def _tokenizer_files(
    out: Path,
    tok,
    model_max_length: int,
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
    chat_template: str = CHAT_TEMPLATE,
) -> dict[str, int]:
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in special_tokens}
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
        "additional_special_tokens": [t for t in special_tokens if t not in (EOS_TOKEN, PAD_TOKEN)],
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "chat_template": chat_template,
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


#: Above this many parameters `random_params` draws in parallel threads (other numbers than the
#: serial draw of the same seed, equally deterministic): a bench-size model (~6 B) takes minutes
#: in one thread. Every test model is far below it.
PARALLEL_DRAW_PARAMS = 1 << 27


def random_params(config: Qwen3MoeConfig, seed: int) -> dict[str, dict[str, np.ndarray]]:
    """Float32 numpy parameters in the `Policy.params()` layout (normal(0, init range))."""
    specs = param_specs(config)
    parallel = sum(math.prod(s.shape) for s in specs.values()) > PARALLEL_DRAW_PARAMS
    rng = np.random.default_rng(seed)
    streams = np.random.SeedSequence(seed)
    out: dict[str, dict[str, np.ndarray]] = {}
    for key, spec in specs.items():
        group, name = key.split(".")
        if spec.init in ("ones", "zeros"):
            value = (np.ones if spec.init == "ones" else np.zeros)(spec.shape, np.float32)
        else:
            std = config.initializer_range if spec.std is None else spec.std
            if parallel:
                value = _parallel_normal(spec.shape, std, streams.spawn(1)[0])
            else:
                value = rng.normal(0.0, std, spec.shape).astype(np.float32)
        out.setdefault(group, {})[name] = value
    return out


def _parallel_normal(shape: tuple[int, ...], std: float, seq: np.random.SeedSequence) -> np.ndarray:
    """f32 normal(0, std) of ``shape``; chunk i from stream i of ``seq`` (`_on_every_core`)."""
    out = np.empty(math.prod(shape), np.float32)
    streams = seq.spawn(len(range(0, out.size, _CHUNK)))

    def fill(start: int) -> None:
        part = out[start : start + _CHUNK]
        np.random.default_rng(streams[start // _CHUNK]).standard_normal(out=part, dtype=np.float32)
        part *= np.float32(std)

    _on_every_core(fill, out.size)
    return out.reshape(shape)


#: Elements per task of `_on_every_core`.
_CHUNK = 1 << 22


def _on_every_core(fill: Callable[[int], None], size: int) -> None:
    """``fill(start)`` for each chunk ``[start, start + _CHUNK)`` of ``size`` elements, in a pool
    of one thread a core (numpy's generators and casts release the GIL)."""  # noqa: D205, D209
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(fill, range(0, size, _CHUNK)))


def tiny_vl_config(
    text: Qwen3MoeConfig, ids: dict[str, int], vision: dict[str, Any] | None = None
) -> Qwen3VLMoeConfig:
    """The tiny Qwen3-VL-MoE: ``text`` plus the tiny ViT (``vision`` overrides its fields)."""
    fields = {f.name for f in dataclasses.fields(VisionConfig)}
    bad = sorted(set(vision or {}) - fields)
    if bad:
        raise ModelConfigError(f"make_tiny_checkpoint: unknown vision overrides {bad}")
    values = {**_TINY_VISION, "out_hidden_size": text.hidden_size, **(vision or {})}
    values["deepstack_visual_indexes"] = tuple(values["deepstack_visual_indexes"])
    half = text.head_dim // 2
    hw = (half // 4) if half >= 4 else 0  # e.g. head_dim 16 -> (4, 2, 2), 128 -> (32, 16, 16)
    text_fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(Qwen3MoeConfig)}
    return Qwen3VLMoeConfig(
        **{**text_fields, "norm_topk_prob": True},
        vision=VisionConfig(**values),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        mrope_section=(half - 2 * hw, hw, hw),
    )


def make_tiny_checkpoint(
    path: str | Path,
    *,
    seed: int = 0,
    kind: str = "qwen3_moe",
    vision: dict[str, Any] | None = None,
    preprocessor: dict[str, Any] | None = None,
    weights: bool = True,
    weights_dtype: str = "float32",
    **overrides: Any,
) -> Path:
    """Writes a random tiny Qwen3-MoE (or Qwen3-VL-MoE) checkpoint + tokenizer into ``path``.

    Args:
      path: output directory (created; existing files of the same names are overwritten).
      seed: seeds the weights (the tokenizer is deterministic on its own).
      kind: "qwen3_moe" (text) or "qwen3_vl_moe" (adds the vision tower and processor files).
      vision: `VisionConfig` fields replacing the tiny ViT's defaults (VL only).
      preprocessor: ``preprocessor_config.json`` keys replacing the tiny processor's (VL only).
      weights: write the random weights (False: every other file, e.g. to validate a run of a
        model too large to make here; ``config.json`` is written either way).
      weights_dtype: "float32" or "bfloat16" (as published checkpoints: half the disk of a
        large random model).
      **overrides: `Qwen3MoeConfig` fields replacing the tiny defaults, e.g.
        ``num_hidden_layers=4``, ``tie_word_embeddings=True``, ``initializer_range=0.2``.

    Returns:
      ``path`` (holding config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
      generation_config.json; VL: also preprocessor_config.json).
    """
    if kind not in KINDS:
        raise ModelConfigError(f"make_tiny_checkpoint: kind {kind!r}; choose one of {KINDS}")
    vl = kind == "qwen3_vl_moe"
    if not vl and (vision is not None or preprocessor is not None):
        raise ModelConfigError("make_tiny_checkpoint: vision/preprocessor need kind='qwen3_vl_moe'")
    specials = VL_SPECIAL_TOKENS if vl else SPECIAL_TOKENS
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(specials)
    n_tok = tok.get_vocab_size()
    vocab = -(-n_tok // 64) * 64  # padded like Qwen's (vocab_size >= tokenizer size)
    overrides = dict(overrides)
    vocab = overrides.pop("vocab_size", vocab)  # a larger embedding (e.g. Qwen's 151,936)
    config = tiny_config(
        vocab, _special_id(tok, EOS_TOKEN), **({**_TINY_VL_TEXT, **overrides} if vl else overrides)
    )
    if vl and config.hidden_size in (
        config.moe_intermediate_size,
        2 * config.moe_intermediate_size,
    ):
        raise ModelConfigError(
            f"make_tiny_checkpoint: hidden_size {config.hidden_size} with moe_intermediate_size "
            f"{config.moe_intermediate_size} makes the fused expert tensors square; transformers "
            "then cannot tell the published layout from its own (pick other sizes)"
        )
    if config.vocab_size < n_tok:
        raise ModelConfigError(
            f"make_tiny_checkpoint: vocab_size {config.vocab_size} < tokenizer size {n_tok}"
        )
    template = VL_CHAT_TEMPLATE if vl else CHAT_TEMPLATE
    ids = _tokenizer_files(out, tok, config.max_position_embeddings, specials, template)
    if vl:
        config = tiny_vl_config(config, ids, vision)
        processor = ImageProcessor.from_dict({**_TINY_PREPROCESSOR, **(preprocessor or {})})
        processor.save_pretrained(out)
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
    if not weights:
        hf = config.to_hf_dict(torch_dtype="float32")
        (out / "config.json").write_text(json.dumps(hf, indent=2))
        return out
    if weights_dtype not in ("float32", "bfloat16"):
        raise ModelConfigError(f"make_tiny_checkpoint: weights_dtype {weights_dtype!r}")
    params = random_params(config, seed)
    tensors = hf_tensors(params, config)
    if weights_dtype == "bfloat16":
        tensors = ((name, _bfloat16(a)) for name, a in tensors)
    write_hf_dir(out, config, tensors, torch_dtype=weights_dtype)
    return out


def _bfloat16(a: np.ndarray) -> np.ndarray:
    """``a`` in bfloat16 (round to nearest even), large arrays converted on every core."""
    if a.size <= 1 << 24:
        return a.astype(ml_dtypes.bfloat16)
    flat, out = a.reshape(-1), np.empty(a.size, ml_dtypes.bfloat16)

    def convert(start: int) -> None:
        out[start : start + _CHUNK] = flat[start : start + _CHUNK]

    _on_every_core(convert, a.size)
    return out.reshape(a.shape)


def _special_id(tok, token: str) -> int:
    i = tok.token_to_id(token)
    assert i is not None, token
    return int(i)
