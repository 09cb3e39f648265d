"""benchmarks/comm_volume.py: its HLO counter and its formulas against XLA's compiled step."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from osworld_jax.model import ModelRuntimeConfig, Qwen3MoeConfig

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return sys.modules[name]


def test_hlo_counter_on_known_collectives():
    # psum of f32[8, 4] (128 bytes) over 4 devices: a ring all-reduce sends 2 x 3/4 x 128 bytes
    # per device; all_gather to [32, 4]: 3/4 x 512; psum_scatter of [8, 4]: 3/4 x 128.
    cv = _load("comm_volume")
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))

    def body(a):
        g = jax.lax.all_gather(a, "x", tiled=True)
        return jax.lax.psum(a, "x"), g, jax.lax.psum_scatter(a, "x", tiled=True)

    fn = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=PartitionSpec(),
            out_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec("x")),
            check_vma=False,
        )
    )
    hlo = fn.lower(jnp.ones((8, 4))).compile().as_text()
    got = cv.hlo_collective_bytes(hlo, 4)
    assert got == {"all-reduce": 192.0, "all-gather": 384.0, "reduce-scatter": 96.0}


def test_loop_bodies_count_once_per_trip():
    cv = _load("comm_volume")
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))

    def body(a):
        return jax.lax.fori_loop(0, 5, lambda i, c: jax.lax.psum(c, "x") * 0.5, a)

    # Each device's f32[16] (64 bytes) summed 5 times: 5 x 2 x 1/2 x 64 bytes sent.
    rows = PartitionSpec("x")
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=rows, out_specs=rows, check_vma=False))
    hlo = fn.lower(jnp.ones((32,))).compile().as_text()
    assert " while(" in hlo  # still a loop after XLA's passes: its trip count is used
    assert cv.hlo_collective_bytes(hlo, 2) == {"all-reduce": 5 * 2 * 1 / 2 * 64}


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh", [dict(expert=2), dict(expert=4), dict(data=2, expert=2)], ids=["e2", "e4", "d2e2"]
)
def test_predicted_bytes_match_the_compiled_train_step(mesh):
    # A small MoE, float32 (4-byte elements: the formulas with c = 4), the whole train step
    # compiled for the mesh: XLA's collectives send what the module docstring says, within 1%
    # (the rest: router statistics, loss and metric scalars).
    cv, ts = _load("comm_volume"), _load("train_step")
    model = Qwen3MoeConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )
    runtime = ModelRuntimeConfig(dtype="float32", scan_layers=True)
    bench = ts.Bench(model=model, runtime=runtime, batch=2, seq=256, logprob_chunk=128)
    got = sum(cv.hlo_bytes(bench, mesh, bench.batch, bench.seq).values())
    predicted = cv.predict(model, mesh, bench.batch * bench.seq, c=4).total
    assert predicted > 0 and abs(got / predicted - 1) < 0.01, (got, predicted)
