"""Real SGLang's in-memory refit paths against the fake server: what it receives through
``/update_weights_from_tensor`` (both formats) and ``/update_weights_from_distributed`` (a gloo
group with a child process) is the disk export, bit for bit; the disk path stays explicit."""  # noqa: D205, D209

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import torch
from flax import nnx

from osworld_jax.contract.refit import StreamedWeights
from osworld_jax.errors import ConfigError
from osworld_jax.model import ModelRuntimeConfig, Policy, save_hf_checkpoint
from osworld_jax.model.safetensors_io import SafetensorsFile
from osworld_jax.model.tiny import tiny_vl_config
from osworld_jax.rollout import RolloutConfig, SGLangClient, SGLangRefitConfig
from osworld_jax.testing import sglang_server
from osworld_jax.testing.sglang_server import FakeServer
from osworld_jax.trainer import sglang_weights
from osworld_jax.trainer.sglang_weights import DistributedSender, buckets
from tests import tiny

BF16 = ModelRuntimeConfig(dtype="bfloat16", expert_backend="dense")
# Qwen3-VL-MoE: fused experts (a concatenation made on the device), the ViT and its mergers.
VL = tiny_vl_config(
    tiny.TINY.replace(num_hidden_layers=2, mlp_only_layers=(0,)),
    {"<|image_pad|>": 60, "<|video_pad|>": 61, "<|vision_start|>": 62, "<|vision_end|>": 63},
    vision={"depth": 2, "deepstack_visual_indexes": (0,)},
)
BUCKET = 40_000  # bytes: the tiny models take several buckets


def _policy(seed: int, config: Any = tiny.TINY) -> Policy:
    return Policy(config, BF16, rngs=nnx.Rngs(seed))


def _disk(policy: Policy, path: Path) -> dict[str, np.ndarray]:
    out = save_hf_checkpoint(policy, path)
    return {
        n: f.get(n)
        for f in map(SafetensorsFile, sorted(out.glob("*.safetensors")))
        for n in f.names()
    }


def _assert_bitwise(received: dict[str, torch.Tensor], disk: dict[str, np.ndarray]) -> None:
    assert list(received) == list(disk)  # the export's names, in its order
    for name, want in disk.items():
        got = received[name]
        assert str(got.dtype).removeprefix("torch.") == want.dtype.name, name
        assert tuple(got.shape) == want.shape, name
        raw = got.contiguous().view(torch.int16 if got.element_size() == 2 else torch.int32)
        np.testing.assert_array_equal(raw.numpy(), want.view(raw.numpy().dtype), err_msg=name)


def _refit(server: FakeServer, weights: StreamedWeights, versions: list[str]) -> None:
    async def main() -> None:
        await server.start()
        client = SGLangClient(
            [server.url], RolloutConfig(urls=(server.url,), flush_poll_interval_s=0.01)
        )
        try:
            for v in versions:
                assert await client.refit(weights, v) == {server.url: None}
        finally:
            await client.aclose()
            await server.stop()

    asyncio.run(main())


def test_buckets_keep_order_one_dtype_and_the_size_bound():
    f32, bf = np.float32, jax.numpy.bfloat16
    named = [
        (f"t{i}", np.zeros(n, d))
        for i, (n, d) in enumerate([(3, f32), (2, f32), (9, f32), (1, bf), (1, bf)])
    ]
    got = list(buckets(named, bucket_bytes=20))
    # 12 + 8 bytes fill the first bucket; the 36-byte tensor is alone; bf16 starts a new one.
    assert [[n for n, _ in b] for b, _ in got] == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    assert [last for _, last in got] == [False, False, True]
    assert [n for b, _ in got for n, _ in b] == [n for n, _ in named]


@pytest.mark.parametrize(
    ("load_format", "session", "config"),
    [(None, False, tiny.TINY), ("flattened_bucket", True, VL)],
)
def test_tensor_refit_serves_the_disk_export_bit_for_bit(
    tmp_path, monkeypatch, load_format, session, config
):
    # Without sglang installed, the flattened format names the fake's twin of its metadata class.
    monkeypatch.setattr(
        sglang_weights, "_flattened_metadata_class", lambda: sglang_server.FlattenedTensorMetadata
    )
    policy = _policy(0, config)
    cfg = SGLangRefitConfig(
        path="tensor", bucket_bytes=BUCKET, load_format=load_format, weight_update_session=session
    )
    server = FakeServer()
    _refit(server, sglang_weights.sglang_weights(policy, cfg, tp_size=2), ["1"])
    _assert_bitwise(server.received, _disk(policy, tmp_path / "disk"))
    bodies = server.update_bodies
    assert len(bodies) >= 2 and server.version == "1"
    assert [b.get("weight_version") for b in bodies] == [None] * (len(bodies) - 1) + ["1"]
    assert [b["flush_cache"] for b in bodies] == [False] * (len(bodies) - 1) + [True]
    assert all(b["load_format"] == load_format for b in bodies)
    updates = [c for c in server.calls if c.startswith(("update", "begin", "end"))]
    wrap = ["begin_weight_update"] * session, ["end_weight_update"] * session
    assert updates == [*wrap[0], *["update_tensor"] * len(bodies), *wrap[1]]


def test_distributed_refit_joins_once_and_serves_each_version_bit_for_bit(tmp_path):
    cfg = SGLangRefitConfig(
        path="distributed", backend="gloo", bucket_bytes=BUCKET, group_timeout_s=120
    )
    sender = DistributedSender(cfg)
    policies = [_policy(0), _policy(1)]
    current: list[Policy] = []
    weights = StreamedWeights(steps=lambda url, v: sender.steps(current[-1], url, v))
    server = FakeServer()

    async def main() -> None:
        await server.start()
        client = SGLangClient(
            [server.url], RolloutConfig(urls=(server.url,), flush_poll_interval_s=0.01)
        )
        try:
            for i, p in enumerate(policies):
                current.append(p)
                assert await client.refit(weights, str(i + 1)) == {server.url: None}
                _assert_bitwise(server.received, _disk(p, tmp_path / f"disk{i}"))
        finally:
            await client.aclose()
            await server.stop()
            sender.close()

    asyncio.run(main())
    assert server.version == "2" and server.calls.count("init_group") == 1
    init = server.update_bodies[0]
    assert init["rank_offset"] == 1 and init["world_size"] == 2 and init["backend"] == "gloo"
    update = server.update_bodies[-1]
    assert update["group_name"] == init["group_name"] and update["weight_version"] == "2"
    assert len(update["names"]) == len(update["dtypes"]) == len(update["shapes"])
    assert set(update["dtypes"]) == {"bfloat16"}


def test_the_disk_path_is_the_default_and_chosen_explicitly():
    cfg = SGLangRefitConfig()
    assert cfg.path == "disk"
    with pytest.raises(ValueError, match="moves no tensors in memory"):
        sglang_weights.sglang_weights(_policy(0), cfg)
    with pytest.raises(ValueError, match="needs a DistributedSender"):
        sglang_weights.sglang_weights(_policy(0), SGLangRefitConfig(path="distributed"))
    with pytest.raises(ConfigError, match="SGLangRefitConfig.path: unknown refit path 'memory'"):
        SGLangRefitConfig(path="memory")
    with pytest.raises(ConfigError, match="SGLangRefitConfig.load_format"):
        SGLangRefitConfig(load_format="safetensors")
