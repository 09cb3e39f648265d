"""The prefix cache's keys and slot choice (host-side, no engine)."""

from __future__ import annotations

import hashlib

import numpy as np

from osworld_jax.server.images import RequestImages
from osworld_jax.server.prefix_cache import PrefixCache, common_prefix, prefix_key, whole_images

PAD = 5


def images(*names: bytes, tokens=(2, 3)) -> RequestImages:
    return RequestImages(
        levels=tuple(np.zeros((0, 3, 1), np.uint8) for _ in names),
        grid_thw=np.zeros((len(names), 3), np.int32),
        num_tokens=tuple(tokens[: len(names)]),
        digests=tuple(hashlib.sha256(n).digest() for n in names),
    )


def test_image_tokens_are_keyed_by_their_image_bytes():
    ids = [1, 3, PAD, PAD, 4, 7, 3, PAD, PAD, PAD, 4, 9]
    a = prefix_key(ids, images(b"a", b"b"), PAD)
    # text keeps its ids; each image's run gets one negative key of its own
    np.testing.assert_array_equal(a[[0, 1, 4, 5, 6, 10, 11]], [1, 3, 4, 7, 3, 4, 9])
    assert (a[[2, 3, 7, 8, 9]] < 0).all() and a[2] == a[3] and a[7] == a[9] and a[2] != a[7]
    b = prefix_key(ids, images(b"a", b"c"), PAD)  # the second image differs
    assert common_prefix(a, b) == 7  # they part at that image's first token
    same = prefix_key(ids, images(b"a", b"b"), PAD)
    assert common_prefix(a, same) == len(ids)
    assert (prefix_key(ids, None, PAD) == np.asarray(ids)).all()  # a text model's keys


def test_a_match_never_ends_inside_an_image():
    key = prefix_key([1, 3, PAD, PAD, PAD, 4], images(b"x", tokens=(3,)), PAD)
    assert [whole_images(key, m) for m in range(7)] == [0, 1, 2, 2, 2, 5, 6]


def test_choose_prefers_the_longest_worthwhile_prefix_then_empty_then_oldest():
    cache = PrefixCache(3)
    routes = np.zeros((8, 2, 1), np.int32)
    cache.store(0, np.arange(8), routes)
    cache.store(1, np.array([0, 1, 2, 9, 9]), routes[:5])
    slot, m, kept = cache.choose([0, 1, 2], np.arange(10), limit=9)
    assert (slot, m) == (0, 8) and kept is not None and kept.shape[0] == 8
    slot, m, _ = cache.choose([0, 1, 2], np.arange(10), limit=5)  # capped by the limit
    assert (slot, m) == (0, 5)
    # not worth it: an empty slot, so the kept sequences survive
    slot, m, kept = cache.choose([0, 1, 2], np.arange(10), limit=9, worth=lambda m: m > 8)
    assert (slot, m, kept) == (2, 0, None)
    cache.store(2, np.array([7]), routes[:1])
    slot, _, _ = cache.choose([0, 1, 2], np.array([42]), limit=0)  # all kept: the oldest
    assert slot == 0
    cache.clear()
    assert cache.choose([1], np.arange(4), limit=3)[1] == 0
    off = PrefixCache(2, enabled=False)
    off.store(0, np.arange(4), routes[:4])
    assert off.entries == [None, None]
