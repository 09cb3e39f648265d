"""The embedded server's programs in the memory plan (abstract weights and cache, CPU)."""

from __future__ import annotations

from osworld_jax.model.serving import cache_layout
from osworld_jax.server.program_memory import (
    abstract_params,
    prefill_buckets,
    prefill_rows,
    server_persistent,
    server_programs,
)
from osworld_jax.trainer.program_memory import device_bytes
from tests.tiny import TINY


def test_prefill_and_decode_donate_the_cache_and_keep_the_weights_once():
    layout = cache_layout(TINY, max_running_requests=2, context_length=32, max_total_tokens=None)
    assert prefill_buckets(layout, 16) == (16, 32)
    assert prefill_rows(16, 8) == 8 and prefill_rows(8192, 8) == 1
    progs = server_programs(TINY, layout, dtype="float32", max_prefill_batch=1, buckets=[16])
    assert [p.name for p in progs] == ["prefill 1x16", "decode 2x32"]
    weights = device_bytes(abstract_params(TINY, "float32"))
    (_, w), (_, refit), (_, kv) = server_persistent(TINY, layout, "float32")
    assert w == refit == weights
    assert kv == 2 * TINY.num_hidden_layers * 2 * 32 * TINY.num_key_value_heads * TINY.head_dim * 4
    for p in progs:
        assert p.persistent == weights + kv  # the weights and the cache are its arguments
        assert p.aliased == kv  # the donated cache is updated in place
        assert p.arguments >= weights + kv and p.transient > 0


def test_a_long_prefill_attends_in_query_blocks_within_the_score_budget(monkeypatch):
    """A 16k-token prompt's full f32 score square is 32 GiB at 32 heads: the prefill bounds it."""
    from osworld_jax.server import buckets, runner

    layout = cache_layout(TINY, max_running_requests=1, context_length=1024, max_total_tokens=None)
    square = 1 * TINY.num_attention_heads * 1024 * 1024 * 4  # [P, N, S, T] f32
    plan = dict(dtype="float32", max_prefill_batch=1, buckets=[1024])
    (whole,) = server_programs(TINY, layout, **plan)[:1]
    assert buckets.prefill_query_chunk(1, 1024, 1024, TINY.num_attention_heads) == 0
    monkeypatch.setattr(buckets, "PREFILL_SCORE_BYTES", square // 16)
    assert buckets.prefill_query_chunk(1, 1024, 1024, TINY.num_attention_heads) == 64
    runner._prefill.clear_cache()  # the same shapes trace again with the new budget
    (blocked,) = server_programs(TINY, layout, **plan)[:1]
    runner._prefill.clear_cache()
    assert whole.transient >= square  # one block: the whole square
    assert blocked.transient < whole.transient - square // 2


def test_a_vl_servers_plan_holds_the_tower_once_and_prefills_of_image_features(tmp_path):
    """The tower compiles on one screenshot (its own program); the prefills take the features
    of a row's images (image tokens, not patches), so no prefill holds the 27-block ViT."""
    from osworld_jax.model import Qwen3MoeConfig
    from osworld_jax.model.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "vl", kind="qwen3_vl_moe", seed=0)
    model = Qwen3MoeConfig.from_json(path / "config.json")
    unit = model.vision.spatial_merge_size**2
    layout = cache_layout(
        model, max_running_requests=2, context_length=64, max_total_tokens=None, min_bucket=16
    )
    # 3 screenshots of 4 x 4 patches in a prompt: 48 patches, 12 image tokens a row
    progs = server_programs(
        model, layout, dtype="float32", max_prefill_batch=2, buckets=[64],
        patches=3 * 16, image_slots=3,
    )  # fmt: skip
    assert 16 // unit == 4 and [p.name for p in progs] == [
        "vision 16p",
        "prefill 2x64",
        "prefill 2x64 12t",
        "decode 2x64",
    ]
