"""Shared fixtures of the agent tests: an offline byte-level BPE tokenizer with Qwen specials."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from osworld_jax.agent import AgentTokenizer, ChatTemplate
from osworld_jax.rollout import Generation

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
]

_CORPUS = [
    "You are an agent that operates a Linux desktop to complete a task.",
    "Accessibility tree: <button name='OK' x=10 y=20/> <window title='Terminal'/>",
    "```python\nimport pyautogui\npyautogui.click(100, 200)\n```",
    "Task instruction: open the terminal and type hello world. DONE WAIT FAIL",
    '```json\n{"action_type": "CLICK", "parameters": {"x": 1, "y": 2}}\n```',
] * 20


def build_tokenizer() -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return tok


@pytest.fixture(scope="session")
def raw_tokenizer() -> tokenizers.Tokenizer:
    return build_tokenizer()


@pytest.fixture(scope="session")
def agent_tokenizer(raw_tokenizer) -> AgentTokenizer:
    return AgentTokenizer(raw_tokenizer, ChatTemplate.builtin_qwen())


@pytest.fixture(scope="session")
def vl_model_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3-VL-MoE checkpoint: tokenizer, Qwen3-VL-shaped chat template and the
    image processor (a 1920x1080 screenshot -> 288x512 pixels -> 144 image tokens)."""
    from osworld_jax.model import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_vl"), kind="qwen3_vl_moe")


@pytest.fixture(scope="session")
def vl_tokenizer(vl_model_dir) -> AgentTokenizer:
    return AgentTokenizer.from_model_dir(vl_model_dir)


def screenshot_png(width: int, height: int, seed: int = 0) -> bytes:
    """A PNG "screen": a gradient with a few seeded rectangles (distinct per seed)."""
    import io

    from PIL import Image, ImageDraw

    x = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None, None]
    rgb = np.concatenate([x + 0 * y, y + 0 * x, (x + y) / 2], axis=-1).astype(np.uint8)
    im = Image.fromarray(rgb)
    draw = ImageDraw.Draw(im)
    rng = np.random.default_rng(seed)
    for _ in range(4):
        x0, y0 = int(rng.integers(0, width - 20)), int(rng.integers(0, height - 20))
        color = tuple(int(c) for c in rng.integers(0, 255, 3))
        draw.rectangle([x0, y0, x0 + 20, y0 + 20], fill=color)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def write_model_dir(path: Path, tok: tokenizers.Tokenizer, chat_template=None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    cfg = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


class ScriptedClient:
    """A fake SGLang client returning real ``Generation``s: scripted texts, tokenised, ending in
    <|im_end|> (stop) or not (length). A reply that is an exception instance is raised.

    Records every request. Routed experts are synthetic but shaped like the server's reply:
    [prompt + completion - 1 - start, L, K]; the route of position p is (p + c) % 8 for call c.
    """

    def __init__(self, tokenizer: AgentTokenizer, replies, *, stop=True, layers=2, top_k=2):
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.stop = stop
        self.layers = layers
        self.top_k = top_k
        self.requests: list[tuple[list[int], object, str]] = []
        self.starts: list[int] = []
        self.images: list[list[str] | None] = []

    async def generate(
        self, input_ids, sampling, *, rid, routed_experts_start_len=0, image_data=None
    ):
        i = len(self.requests)
        self.requests.append((list(input_ids), sampling, rid))
        self.starts.append(routed_experts_start_len)
        self.images.append(image_data)
        text = self.replies[i % len(self.replies)]
        if isinstance(text, BaseException):
            raise text
        out = self.tokenizer.encode(text).tolist()
        if self.stop:
            out.append(self.tokenizer.token_id("<|im_end|>"))
        s = routed_experts_start_len
        n = len(input_ids) + len(out) - 1
        routes = (np.arange(s, n)[:, None, None] + i + np.zeros((1, self.layers, self.top_k))) % 8
        return Generation(
            output_ids=out,
            output_logprobs=[-0.5 - 0.01 * k for k in range(len(out))],
            routed_experts=routes.astype(np.int32),
            finish_reason={"type": "stop", "matched": out[-1]}
            if self.stop
            else {"type": "length", "length": len(out)},
            prompt_tokens=len(input_ids),
            completion_tokens=len(out),
            weight_version="v1",
            rid=rid,
            text=text,
            routed_experts_start_len=s,
        )
