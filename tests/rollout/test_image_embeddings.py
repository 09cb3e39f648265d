"""The server's image-embedding cache (`server/image_embeddings.py`): the vision tower runs once
per image content; what it serves from the cache equals what it computes; a weight change and
/flush_cache forget it; the byte budget evicts the least recently used."""

from __future__ import annotations

import numpy as np

from osworld_jax.server.image_embeddings import ImageEmbeddings, feature_bucket

from .conftest import serving
from .test_images import PAD, b64, body, chat, png, run
from .test_server import post


def random_levels(rng: np.random.Generator, eng, n: int = 16) -> np.ndarray:
    """u8[n, C, P P]: the patch levels of an image of ``n`` patches (`ImageProcessor.levels`)."""
    p = eng.processor.patch_size
    return rng.integers(0, 256, size=(n, 3, p * p), dtype=np.uint8)


def embeddings(eng, max_bytes: int) -> ImageEmbeddings:
    return ImageEmbeddings(eng.model_config, eng.runner.runtime, max_bytes, eng.processor)


def test_the_device_lookup_of_levels_feeds_the_tower_the_processors_patches(vl_engine):
    """The server sends uint8 patch levels (1 / (4 T) of the float32 patches' bytes) and looks
    the values up on the device: the tower's outputs are those of the processor's patches."""
    import jax

    from osworld_jax.model.vision import vision_tower

    eng = vl_engine
    raw = png(23, 64, 96)
    levels, grid = eng.processor.levels(raw)
    patches, grid2 = eng.processor(raw)
    np.testing.assert_array_equal(grid, grid2)

    def go():
        e, d = embeddings(eng, 0).get(eng.runner.params, b"", levels, grid[0])
        ref = jax.jit(vision_tower, static_argnums=(1, 2))(
            eng.runner.params, eng.model_config.vision, eng.runner.runtime,
            patches[None], grid[None],
        )  # fmt: skip
        return e, d, ref

    e, d, ref = eng.call(go).result()
    tokens = levels.shape[0] // eng.model_config.vision.spatial_merge_size**2
    np.testing.assert_allclose(
        np.asarray(e), np.asarray(ref.embeds[0, :tokens]), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        np.asarray(d), np.asarray(ref.deepstack[0, :, :tokens]), rtol=1e-5, atol=1e-6
    )


def test_an_image_goes_through_the_tower_once_and_the_cached_features_serve_the_same(vl_engine):
    """Two prompts that differ before the image share no KV: the second takes the image's
    embeddings from the cache (no second tower run) and answers exactly as after a flush
    (which forgets them, so the tower runs again)."""
    eng = vl_engine
    emb = eng.runner.embeddings
    a = b64(png(21, 64, 64))
    one, two = chat(eng, "Open ", PAD, " now"), chat(eng, "Close the window ", PAD, " now")

    def greedy(ids):
        return {**body(ids, [a], temperature=0.0), "logprob_start_len": -1}

    async def main():
        async with serving(eng) as url:
            await post(url, "/flush_cache", {})
            e0, h0 = emb.encoded, emb.hits
            first = (await post(url, "/generate", greedy(one)))[1]
            cached = (await post(url, "/generate", greedy(two)))[1]
            counts = (emb.encoded - e0, emb.hits - h0)
            await post(url, "/flush_cache", {})
            assert emb.bytes == 0
            fresh = (await post(url, "/generate", greedy(two)))[1]
            return first, cached, fresh, counts, emb.encoded - e0

    first, cached, fresh, counts, encoded = run(main())
    assert cached["meta_info"]["cached_tokens"] == 0  # no prefix: the prompts differ at once
    assert counts == (1, 1)  # one tower run for two prompts of the same image
    assert encoded == 2  # after the flush the tower ran again
    assert cached["output_ids"] == fresh["output_ids"]
    assert [e[0] for e in cached["meta_info"]["output_token_logprobs"]] == [
        e[0] for e in fresh["meta_info"]["output_token_logprobs"]
    ]  # bit for bit: the same program on the same inputs
    assert cached["meta_info"]["routed_experts"] == fresh["meta_info"]["routed_experts"]


def test_a_weight_change_forgets_the_embeddings(vl_engine):
    eng = vl_engine

    def put():
        eng.runner.embeddings.get(eng.runner.params, b"x" * 32, levels, grid)

    vision = eng.model_config.vision
    unit = vision.spatial_merge_size**2
    grid = np.asarray([1, 4, 4], np.int32)
    levels = random_levels(np.random.default_rng(0), eng)
    eng.call(put).result()
    assert eng.runner.embeddings.bytes > 0 and 16 // unit == 4
    eng.call(lambda: setattr(eng.runner, "params", eng.runner.params)).result()
    assert eng.runner.embeddings.bytes == 0


def test_the_byte_budget_keeps_the_most_recent_images(vl_engine):
    eng = vl_engine
    vision = eng.model_config.vision
    grid = np.asarray([1, 4, 4], np.int32)
    rng = np.random.default_rng(1)
    images = [random_levels(rng, eng) for _ in range(3)]

    def go():
        params = eng.runner.params
        probe = embeddings(eng, 1 << 30)
        e, d = probe.get(params, b"p", images[0], grid)
        size = e.nbytes + d.nbytes  # one image: 4 tokens x (1 + DeepStack levels) x H
        levels = len(vision.deepstack_visual_indexes)
        assert e.shape == (4, eng.model_config.hidden_size) and d.shape[:2] == (levels, 4)
        cache = embeddings(eng, 2 * size)
        for i in (0, 1, 0, 2):  # 0 is used again before 2 arrives: 1 is the oldest then
            cache.get(params, bytes([i]), images[i], grid)
        kept = set(cache._kept)
        again = cache.get(params, bytes([0]), None, grid)  # a hit needs no levels
        none = embeddings(eng, 0)
        none.get(params, b"z", images[0], grid)
        return kept, (cache.encoded, cache.hits), again, e, none.bytes

    kept, counts, again, e, nothing = eng.call(go).result()
    assert kept == {bytes([0]), bytes([2])} and counts == (3, 2)
    np.testing.assert_array_equal(np.asarray(again[0]), np.asarray(e))
    assert nothing == 0


def test_feature_buckets():
    assert [feature_bucket(n) for n in (0, 3, 2040, 4080, 6120)] == [1, 3, 2048, 4096, 6144]
