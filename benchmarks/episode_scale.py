"""Real-scale episodes through the agent room (issue 30, section 3): CPU, no model forward.

Synthetic owners with the seed's shapes go through the real `ContextManager` (prompts, declared
compactions), `build_segments`, `GroupSelection` and `pack_batch` (with Qwen3-VL's image
processor at its real pixel budget: a 1920x1080 screenshot is 8,160 patches, 2,040 tokens):

- 15 turns per owner; each turn a 1920x1080 desktop-like PNG (taskbar, windows, text; varied
  per turn and per owner); an OSWorld-style XML accessibility tree; a reply of ~100 tokens.
- The tokenizer is the tiny checkpoint's byte-level BPE (~1.5 chars/token on these trees, Qwen's
  151k vocabulary ~3): the tree is sized (~9.5k chars, ~6.5k tokens here) to the token count
  Qwen gives a tree at ``AgentConfig.a11y_max_chars`` = 20,000 chars, the seed's trim.

It prints per owner: rows, forward tokens (segment tokens) and padded row tokens per trained
token, ViT patches per trained token; per step (B x N owners): the host batch's bytes (arrays
and the screenshots, each stored once as its PNG: `RowImages`), the same rows' bytes in the
former layout (float32 patches per row, `with_pixel_values`) and the time to make them (the
trainer now does it per device shard at upload), the peak RSS growth of packing, pack time.
The former layout of a whole step does not fit in this machine's memory, so ``--pack-owners``
owners are packed (one `pack_batch` call) and the step's bytes / time are that times
``B * N / pack_owners`` (printed as extrapolated).

Run (the "before" column: today's behaviour by config)::

    python benchmarks/episode_scale.py --low-water 3 --keep-old-text
    python benchmarks/episode_scale.py                 # the defaults

The seed's shapes (issue 42): ``--gin`` takes the agent config (context 49,152 tokens, 11,152
reserved, the seed's screenshot window) and the turns (150) from a recipe, and prints the
train step's memory plan at the recipe's row length for Qwen3-VL-30B-A3B's shapes
(`trainer.memory.estimate_step_memory`, per device of the recipe's mesh; rows = the rows the
owners here make per step, and the run's validate estimate of B x N rows), with the recipe's
freezing and without it::

    python benchmarks/episode_scale.py --gin configs/osworld_flash_b8n8_r3_dr_grpo.gin \
        --owners 1 --skip-former
"""

from __future__ import annotations

import argparse
import io
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from osworld_jax import config as gin_config
from osworld_jax.agent import AgentConfig, AgentTokenizer
from osworld_jax.agent.batching import GroupSelection, VisionPacking, pack_batch
from osworld_jax.agent.context import ContextManager
from osworld_jax.agent.history import CallRecord, History
from osworld_jax.agent.owner import OwnerRollout
from osworld_jax.agent.segments import build_segments
from osworld_jax.batch import Batch, host_nbytes, with_pixel_values
from osworld_jax.env.backend import Observation
from osworld_jax.model import make_tiny_checkpoint
from osworld_jax.model.processor import QWEN3_VL_PREPROCESSOR, ImageProcessor
from osworld_jax.model.vl_config import Qwen3VLMoeConfig

GiB = 1 << 30
MiB = 1 << 20
INSTRUCTION = (
    "Open the spreadsheet report.xlsx on the Desktop, sort the table by the Revenue column in "
    "descending order, add a total row under it and save the file as report_sorted.xlsx."
)
_APPS = ["Chromium", "LibreOffice Calc", "Terminal", "Files", "Text Editor", "Settings"]
_ROLES = ["push-button", "menu-item", "label", "entry", "table-cell", "link", "check-box"]


def desktop_png(owner: int, turn: int, width: int = 1920, height: int = 1080) -> bytes:
    """A desktop-like screenshot: wallpaper, top bar, 2-3 windows with text rows and widgets."""
    rng = np.random.default_rng(1000 * owner + turn)
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None, None]
    base = np.array([40, 60, 90], np.float32) + np.array([30, 20, 60], np.float32) * y
    rgb = np.broadcast_to(base, (height, width, 3)).astype(np.uint8)
    im = Image.fromarray(rgb)
    draw = ImageDraw.Draw(im)
    draw.rectangle([0, 0, width, 28], fill=(30, 30, 30))
    draw.text((12, 8), f"Activities   {_APPS[turn % len(_APPS)]}   10:{turn:02d}", fill="white")
    for w in range(2 + turn % 2):
        x0 = int(rng.integers(40, width // 2))
        y0 = int(rng.integers(50, height // 2))
        x1 = min(width - 20, x0 + int(rng.integers(600, 1100)))
        y1 = min(height - 20, y0 + int(rng.integers(350, 600)))
        draw.rectangle([x0, y0, x1, y1], fill=(245, 245, 245), outline=(90, 90, 90))
        draw.rectangle([x0, y0, x1, y0 + 30], fill=(220, 220, 225))
        draw.text((x0 + 10, y0 + 9), f"{_APPS[(w + turn) % len(_APPS)]} - window {w}", fill="black")
        for r in range(y0 + 45, y1 - 20, 22):
            words = " ".join(f"cell{int(rng.integers(0, 9999))}" for _ in range(8))
            draw.text((x0 + 14, r), words[: (x1 - x0 - 28) // 7], fill=(20, 20, 20))
        for _ in range(4):
            bx = int(rng.integers(x0, max(x0 + 1, x1 - 90)))
            by = int(rng.integers(y0 + 40, max(y0 + 41, y1 - 30)))
            color = tuple(int(c) for c in rng.integers(0, 255, 3))
            draw.rectangle([bx, by, bx + 80, by + 24], fill=color)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def a11y_tree(owner: int, turn: int, nodes: int = 76) -> str:
    """An OSWorld-style XML accessibility tree (AT-SPI roles, names, coordinates, sizes)."""
    rng = np.random.default_rng(7 + 1000 * owner + turn)
    lines = ['<desktop-frame name="main" cp:screencoord="(0, 0)" cp:size="(1920, 1080)">']
    for k in range(nodes):
        role = _ROLES[int(rng.integers(0, len(_ROLES)))]
        x, y = int(rng.integers(0, 1900)), int(rng.integers(0, 1060))
        name = f"{_APPS[k % len(_APPS)]} item {int(rng.integers(0, 10**5))}"
        lines.append(
            f'  <{role} name="{name}" st:enabled="true" st:visible="true" '
            f'cp:screencoord="({x}, {y})" cp:size="({int(rng.integers(10, 300))}, 24)"/>'
        )
    lines.append("</desktop-frame>")
    return "\n".join(lines)


def reply_text(tokenizer: AgentTokenizer, turn: int, target: int = 100) -> str:
    """A reply (a short thought and a pyautogui action) of about ``target`` tokens."""
    thought = (
        f"The window shows the table; step {turn}: I will click the Revenue header, then check "
        "that the sort order changed before adding the total row. "
    )
    action = (
        f"```python\nimport pyautogui\npyautogui.click({300 + 7 * turn}, {200 + 5 * turn})\n```"
    )
    text = thought + action
    while tokenizer.encode(text).size < target:
        text = thought + text
    ids = tokenizer.encode(text)
    while ids.size > target + 10 and len(text) > len(action) + 10:
        text = text[20:]
        ids = tokenizer.encode(text)
    return text


def run_owner(
    owner: int, group: int, tokenizer: AgentTokenizer, config: AgentConfig, turns: int
) -> tuple[OwnerRollout, dict[str, float]]:
    """One synthetic owner through the real context and segments."""
    ctx = ContextManager(tokenizer, config)
    media = ctx.media_token_ids()
    history = History(
        owner_id=owner, group_id=group, media_token_ids=media, image_token_id=ctx.image_token_id
    )
    end = tokenizer.token_id("<|im_end|>")
    compactions = 0
    for turn in range(turns):
        obs = Observation(
            screenshot=desktop_png(owner, turn),
            a11y_tree=a11y_tree(owner, turn),
            terminal="",
            instruction=INSTRUCTION,
        )
        prompt, compaction = ctx.next_prompt(obs)
        if compaction is not None:
            history.declare_compaction(compaction)
            compactions += 1
        text = reply_text(tokenizer, turn)
        out = np.concatenate([tokenizer.encode(text), [end]]).astype(np.int32)
        history.record_call(
            CallRecord(
                prompt_ids=prompt,
                output_ids=out,
                output_logprobs=np.full(out.size, -0.5, np.float32),
                routed_experts=None,
                finish_reason={"type": "stop"},
                weight_version="0",
                images=tuple(im.png for im in ctx.prompt_images),
            )
        )
        ctx.record_reply(out, text)
    segments = build_segments(history)
    rollout = OwnerRollout(
        owner_id=owner,
        group_id=group,
        segments=tuple(segments),
        reward=float(owner % 2),
        failed=False,
    )
    processor = tokenizer.image_processor
    assert processor is not None
    patches_per_image = {}
    for seg in segments:
        for png in seg.images:
            if png not in patches_per_image:
                with Image.open(io.BytesIO(png)) as im:
                    w, h = im.size
                t, gh, gw = processor.grid_thw(h, w)
                patches_per_image[png] = t * gh * gw
    stats = {
        "rows": len(segments),
        "forward_tokens": sum(s.length for s in segments),
        "trained_tokens": sum(s.num_trainable for s in segments),
        "vit_patches": sum(patches_per_image[p] for s in segments for p in s.images),
        "images_shown": sum(len(s.images) for s in segments),
        "distinct_images": len(patches_per_image),
        "png_bytes": sum(len(p) for p in patches_per_image),
        "level_bytes": sum(n * 3 * processor.patch_size**2 for n in patches_per_image.values()),
        "compactions": compactions,
        "longest_row": max(s.length for s in segments),
    }
    return rollout, stats


def batch_bytes(batch: Batch) -> int:
    """Host bytes of the batch: its arrays and its stored screenshots (`batch.host_nbytes`)."""
    return host_nbytes(batch)


def image_bytes(batch: Batch) -> int:
    """Host bytes of the batch's images: float32 ``pixel_values``, or the stored PNGs + index."""
    if batch.images is not None:
        return batch.images.nbytes
    return 0 if batch.pixel_values is None else int(batch.pixel_values.nbytes)


def rss_mib() -> float:
    """Peak RSS of this process so far (MiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def qwen3_vl_30b_a3b() -> Qwen3VLMoeConfig:
    """Qwen3-VL-30B-A3B-Instruct's shapes (its config.json: 48 layers, 128 experts top-8, the
    27-block ViT with DeepStack at 8, 16, 24), random-free: shapes only."""
    from osworld_jax.model.tiny import tiny_config, tiny_vl_config

    ids = {"<|image_pad|>": 151655, "<|video_pad|>": 151656}
    ids |= {"<|vision_start|>": 151652, "<|vision_end|>": 151653}
    text = tiny_config(
        151936,
        151645,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        mlp_only_layers=[],
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        max_position_embeddings=262144,
    )
    vision = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16}
    vision |= {"num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24]}
    return tiny_vl_config(text, ids, vision)


def memory_plan(exp: object, rows_per_step: float, patches: int) -> None:
    """The recipe's train step at its longest row, per device, frozen as the recipe and not."""
    import dataclasses

    from osworld_jax.trainer.memory import estimate_step_memory

    model = qwen3_vl_30b_a3b()
    m = exp.rl.mesh  # type: ignore[attr-defined]
    seq = max(exp.rl.length_buckets, default=exp.agent.compaction.max_context_tokens)  # type: ignore[attr-defined]
    trainer = exp.trainer  # type: ignore[attr-defined]
    opt = trainer.optimizer
    trained = dataclasses.replace(
        trainer, optimizer=dataclasses.replace(opt, freeze_router=False, freeze_vision=False)
    )
    dp = m.data * m.fsdp * m.expert  # the trainer's batch axes
    for name, cfg in (("recipe (frozen)", trainer), ("router+tower trained", trained)):
        est = estimate_step_memory(
            model,
            exp.runtime,  # type: ignore[attr-defined]
            cfg,
            rows=dp * cfg.num_micro_batches,  # one row per device per micro-batch
            seq=seq,
            param_shards=m.fsdp * m.expert * m.tensor,
            batch_shards=dp,
            patches=patches,
        )
        print(
            f"  memory plan per device ({dp} devices, one {seq}-token row with {patches} "
            f"patches per device per micro-batch), {name}: {est.describe()}"
        )
    print(
        f"  rows per step {rows_per_step:.0f}: {rows_per_step / dp:.0f} micro-batches of one "
        f"row per device (the recipe's num_micro_batches = {trainer.num_micro_batches} gives "
        f"{rows_per_step / (dp * trainer.num_micro_batches):.0f} rows per device each)"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gin", default=None, help="a recipe: its agent config, turns, memory plan")
    p.add_argument("--skip-former", action="store_true", help="skip the float32-patches layout")
    p.add_argument("--turns", type=int, default=None, help="default 15, or the recipe's")
    p.add_argument("--owners", type=int, default=2, help="owners run through the context")
    p.add_argument("--pack-owners", type=int, default=1, help="owners packed in one pack_batch")
    p.add_argument("--recipes", default="8x8,17x16", help="B x N per step, comma separated")
    p.add_argument("--max-screenshots", type=int, default=3)
    p.add_argument(
        "--low-water",
        type=int,
        default=None,
        help="AgentConfig.screenshots_after_compaction (absent on old code: not passed)",
    )
    p.add_argument(
        "--keep-old-text",
        action="store_true",
        help="AgentConfig.placeholder_old_observations=False (absent on old code: not passed)",
    )
    p.add_argument("--layers", type=int, default=48, help="L of routed_experts (Qwen3-VL-30B)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument(
        "--experts",
        type=int,
        default=128,
        help="E of the model (Qwen3-VL-30B: 128; routes in int8); 0: int32 routes as before",
    )
    args = p.parse_args(argv)

    extra: dict[str, object] = {}
    if args.low_water is not None:
        extra["screenshots_after_compaction"] = args.low_water
    if args.keep_old_text:
        extra["placeholder_old_observations"] = False
    config = AgentConfig(max_screenshots=args.max_screenshots, **extra)  # type: ignore[arg-type]
    exp = None
    if args.gin:
        exp = gin_config.load_experiment([args.gin])
        config = exp.agent.replace(**extra) if extra else exp.agent
    if args.turns is None:
        args.turns = exp.env.max_turns if exp is not None else 15
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_checkpoint(
            Path(tmp) / "m", kind="qwen3_vl_moe", preprocessor=dict(QWEN3_VL_PREPROCESSOR)
        )
        tokenizer = AgentTokenizer.from_model_dir(model_dir)
        processor = ImageProcessor.from_pretrained(model_dir)
        vl = Qwen3VLMoeConfig.from_hf_dict(json.loads((model_dir / "config.json").read_text()))
    sample = a11y_tree(0, 0)
    print(
        f"# config: {config}\n# a11y tree {len(sample)} chars (trimmed to "
        f"{config.a11y_max_chars}); tokenizer {len(sample) / tokenizer.encode(sample).size:.2f} "
        f"chars/token; reply ~{tokenizer.encode(reply_text(tokenizer, 0)).size} tokens; "
        f"screenshot {processor.grid_thw(1080, 1920)} patches grid, "
        f"{processor.num_image_tokens(1080, 1920)} tokens"
    )
    rollouts, stats = [], []
    t0 = time.perf_counter()
    for k in range(args.owners):
        r, s = run_owner(k, k // 8, tokenizer, config, args.turns)
        rollouts.append(r)
        stats.append(s)
    t_ctx = (time.perf_counter() - t0) / args.owners
    mean = {key: float(np.mean([s[key] for s in stats])) for key in stats[0]}
    trained = mean["trained_tokens"]
    print(
        f"per owner ({args.owners} owners, {args.turns} turns, context+segments "
        f"{t_ctx:.2f} s/owner): rows {mean['rows']:.1f}, compactions {mean['compactions']:.1f}, "
        f"longest row {mean['longest_row']:.0f} tokens, trained tokens {trained:.0f}, "
        f"forward tokens/trained {mean['forward_tokens'] / trained:.1f}, "
        f"ViT patches/trained {mean['vit_patches'] / trained:.1f}, images shown in rows "
        f"{mean['images_shown']:.0f} of {mean['distinct_images']:.0f} distinct"
    )
    vision = VisionPacking(processor=processor, config=vl)
    pack = rollouts[: args.pack_owners]
    selection = GroupSelection.of(pack)
    rss0 = rss_mib()
    t0 = time.perf_counter()
    batch = pack_batch(
        selection,
        np.ones(len(pack), np.float32),
        num_layers=args.layers,
        top_k=args.top_k,
        num_experts=args.experts or None,
        vision=vision,
        length_buckets=(exp.rl.length_buckets or None) if exp is not None else None,
    )
    t_pack = time.perf_counter() - t0
    rss = rss_mib() - rss0
    nbytes, pix_bytes = batch_bytes(batch), image_bytes(batch)
    route_bytes = int(batch.routed_experts.nbytes)
    r_, t_ = batch.tokens.shape
    padded = r_ * t_ / (trained * len(pack))
    stored = batch.images
    print(
        f"pack_batch of {len(pack)} owner(s): R={r_} T={t_}, "
        f"{0 if stored is None else len(stored.encoded)} distinct screenshots stored once "
        f"({pix_bytes / MiB:.1f} MiB with the index), arrays + images {nbytes / MiB:.0f} MiB, "
        f"peak RSS +{rss:.0f} MiB, {t_pack:.2f} s; padded row tokens/trained {padded:.1f}"
    )
    # The former host layout of the same rows: every row's float32 patches (what the trainer
    # now makes per device shard at upload; `with_pixel_values` makes them for all rows).
    old_bytes = old_pix = row_pix = 0
    t_patch = 0.0
    if not args.skip_former:
        t0 = time.perf_counter()
        dense = with_pixel_values(batch)
        t_patch = time.perf_counter() - t0
        old_bytes, old_pix = batch_bytes(dense), image_bytes(dense)
        row_pix = 0 if dense.pixel_values is None else dense.pixel_values[0].nbytes
        del dense
        print(
            f"  the same rows as float32 patches (the former host batch): pixel_values "
            f"{old_pix / MiB:.0f} MiB, arrays {old_bytes / MiB:.0f} MiB; making them "
            f"{t_patch:.2f} s; one row's patches {row_pix / MiB:.0f} MiB (the trainer's upload "
            f"holds one device shard's rows of them at a time)"
        )
    for recipe in args.recipes.split(","):
        b, n = (int(x) for x in recipe.lower().split("x"))
        scale = b * n / len(pack)
        print(
            f"B{b}/N{n} ({b * n} owners; extrapolated x{scale:.0f} from the packed owners): "
            f"host batch {nbytes * scale / GiB:.2f} GiB (screenshots "
            f"{pix_bytes * scale / GiB:.2f}, routes {route_bytes * scale / GiB:.1f}); "
            + (
                ""
                if args.skip_former
                else f"former layout {old_bytes * scale / GiB:.1f} GiB (pixels "
                f"{old_pix * scale / GiB:.1f}) -> x{nbytes / old_bytes:.3f}; "
            )
            + f"peak RSS of packing +{rss * scale / 1024:.1f} GiB, pack {t_pack * scale:.0f} s, "
            f"patches at upload {t_patch * scale:.0f} s, rows {mean['rows'] * b * n:.0f}; "
            f"uint8 patch levels once would be {mean['level_bytes'] * b * n / GiB:.1f} GiB"
        )
    if exp is not None:
        b, n = exp.rl.num_prompts, exp.rl.num_owners
        shown = config.screenshot_window + config.protected_observations
        patches = shown * int(np.prod(processor.grid_thw(1080, 1920)))
        memory_plan(exp, mean["rows"] * b * n, patches)
    return 0


if __name__ == "__main__":
    sys.exit(main())
