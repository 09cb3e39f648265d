"""The colocated server: the embedded server in the trainer's process, refitted by hand-over.

The served parameters after a refit are the staged arrays bit for bit (and the reply's digest
says so); a tree of another shape is refused with the old weights kept; a server of its own
process refuses staged handles; a digest that disagrees takes the server out of rotation.
"""

from __future__ import annotations

import asyncio

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osworld_jax.contract.errors import RefitError
from osworld_jax.contract.refit import STAGED_FORMAT, TensorWeights
from osworld_jax.model import ModelRuntimeConfig, load_hf_checkpoint
from osworld_jax.model.digest import params_digest
from osworld_jax.rollout import RolloutConfig, SamplingParams, SGLangClient
from osworld_jax.server.colocated import ColocatedServer

from .conftest import ENGINE_KW, serving

ARGV = [
    "--port", "0", "--max-running-requests", str(ENGINE_KW["max_running_requests"]),
    "--context-length", str(ENGINE_KW["context_length"]),
    "--min-bucket", str(ENGINE_KW["min_bucket"]),
    "--min-decode-batch", str(ENGINE_KW["min_decode_batch"]),
    "--enable-return-routed-experts", "--dtype", "float32", "--weight-version", "v0",
]  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


def _params(path):
    return load_hf_checkpoint(path, runtime=ModelRuntimeConfig(dtype="float32")).params()


def _client(url, cfg):
    return SGLangClient(
        None,
        RolloutConfig(
            urls=(url,),
            return_routed_experts=True,
            num_layers=cfg.num_hidden_layers,
            num_experts_per_tok=cfg.num_experts_per_tok,
        ),
    )


@pytest.fixture(scope="module")
def colocated(tiny_ckpt, tmp_path_factory):
    log = tmp_path_factory.mktemp("colocated") / "server.log"
    with ColocatedServer(["--model-path", str(tiny_ckpt), *ARGV], log_path=log) as srv:
        yield srv


def test_a_staged_refit_serves_the_trainers_arrays_bit_for_bit(colocated, tiny_ckpt_b):
    new = _params(tiny_ckpt_b)
    engine_cfg = load_hf_checkpoint(tiny_ckpt_b).config

    async def run():
        client = _client(colocated.url, engine_cfg)
        try:
            before = await client.generate([1, 2, 3, 4], GREEDY, rid="before")
            weights = colocated.stage(new, expected_digest=params_digest(new))
            report = await client.refit(weights, "1")
            after = await client.generate([1, 2, 3, 4], GREEDY, rid="after")
            return before, report, after
        finally:
            await client.aclose()

    before, report, after = asyncio.run(run())
    assert report == {colocated.url: None}
    chex.assert_trees_all_equal(colocated.served_params, new)  # the same values, every leaf
    leaf = jax.tree.leaves(new)[0]
    assert jax.tree.leaves(colocated.served_params)[0] is leaf  # handed over, not copied
    assert after.weight_versions[-1] == "1" and before.weight_versions[-1] == "v0"
    assert len(colocated.staging) == 0  # taken by the refit


def test_a_tree_of_another_shape_is_refused_and_the_old_weights_stay(colocated):
    served = colocated.served_params
    bad = jax.tree.map(lambda x: x, served)
    bad["top"]["embed"] = jnp.zeros((3, 5), jnp.float32)  # [V, H] -> [3, 5]

    async def run():
        client = _client(colocated.url, load_hf_checkpoint_config(colocated))
        try:
            with pytest.raises(RefitError, match=r"\['top'\]\['embed'\].*float32\[3, 5\]"):
                await client.refit(colocated.stage(bad), "bad")
        finally:
            await client.aclose()

    asyncio.run(run())
    assert colocated.served_params is served


def test_a_digest_that_disagrees_takes_the_server_out_of_rotation(colocated, tiny_ckpt):
    new = _params(tiny_ckpt)
    wrong = params_digest(jax.tree.map(lambda x: x + 1.0, new))

    async def run():
        client = _client(colocated.url, load_hf_checkpoint_config(colocated))
        try:
            with pytest.raises(RefitError, match="not bit-exact"):
                await client.refit(colocated.stage(new, expected_digest=wrong), "2")
            return client.servers[0].in_rotation
        finally:
            await client.aclose()

    assert asyncio.run(run()) is False


def test_a_server_of_its_own_process_refuses_staged_handles(engine):
    import aiohttp

    async def run():
        async with serving(engine) as url, aiohttp.ClientSession() as s:
            body = {"serialized_named_tensors": ["staged-x"], "load_format": STAGED_FORMAT}
            async with s.post(url + "/update_weights_from_tensor", json=body) as r:
                return r.status, await r.json()

    status, body = asyncio.run(run())
    assert status == 400 and body["success"] is False
    assert "colocated" in body["message"]
    weights = TensorWeights(buckets=(("h",),), load_format=STAGED_FORMAT)
    ((endpoint, req),) = weights.requests("7")
    assert endpoint == "/update_weights_from_tensor" and req["weight_version"] == "7"
    assert req["flush_cache"] is True and req["serialized_named_tensors"] == ["h"]


def load_hf_checkpoint_config(srv):
    from osworld_jax.model import Qwen3MoeConfig

    return Qwen3MoeConfig.from_json(f"{srv.args.model_path}/config.json")


def test_the_digest_sees_one_flipped_bit_and_a_transpose():
    x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4) / 7
    tree = {"a": x, "b": jnp.ones((2,), jnp.bfloat16)}
    same = {"a": jnp.array(np.asarray(x)), "b": jnp.ones((2,), jnp.bfloat16)}
    assert params_digest(tree) == params_digest(same)
    bits = np.asarray(x).view(np.uint32).copy()
    bits[1, 2] ^= 1  # the last bit of one element
    flipped = {"a": jnp.asarray(bits.view(np.float32)), "b": tree["b"]}
    assert params_digest(flipped) != params_digest(tree)
    sq = jnp.arange(16, dtype=jnp.float32).reshape(4, 4)
    assert params_digest({"a": sq}) != params_digest({"a": sq.T})


def test_a_disk_refit_is_checked_bit_for_bit_too(colocated, tiny_ckpt_b, tmp_path):
    from osworld_jax.contract.refit import DiskWeights
    from osworld_jax.model import save_hf_checkpoint

    policy = load_hf_checkpoint(tiny_ckpt_b, runtime=ModelRuntimeConfig(dtype="float32"))
    export = save_hf_checkpoint(policy, tmp_path / "export", copy_files_from=tiny_ckpt_b)
    digest = params_digest(policy.params())

    async def run():
        client = _client(colocated.url, policy.config)
        try:
            await client.refit(DiskWeights(path=str(export), expected_digest=digest), "disk")
        finally:
            await client.aclose()

    asyncio.run(run())
    chex.assert_trees_all_equal(colocated.served_params, policy.params())
    assert params_digest(colocated.served_params) == digest
