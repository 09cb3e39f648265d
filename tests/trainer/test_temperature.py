"""The trainer scores tokens at the temperature the rollout logprobs refer to (issue 14 item 1).

SGLang's (and the embedded server's) ``output_token_logprobs`` are ``log_softmax(z / T)`` of the
full vocabulary, ``T = logprob_temperature(SamplingParams.temperature, return_original_logprob)``
(1 for greedy requests and for servers run with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``). The run
derives the trainer's temperature from the sampling config (`ExperimentConfig.logprob_temperature`)
and the chunked head divides its float32 logits by it.
"""

from __future__ import annotations

import asyncio

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osworld_jax.batch import Batch, BatchBounds
from osworld_jax.errors import ConfigError
from osworld_jax.rl.config import ExperimentConfig, ServerConfig
from osworld_jax.rollout import RolloutConfig, SamplingParams
from osworld_jax.trainer import Trainer
from osworld_jax.trainer.logprobs import token_logprobs
from tests.trainer._tiny import trainer_config


def _naive(hidden, w, tokens, temperature):
    logits = jnp.einsum("rth,hv->rtv", hidden, w, preferred_element_type=jnp.float32)
    logp = jax.nn.log_softmax(logits / temperature, axis=-1)
    lp = jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)[:, :-1]
    zero = jnp.zeros((tokens.shape[0], 1), jnp.float32)
    return jnp.concatenate([zero, lp], 1), jnp.concatenate([zero, ent], 1)


@pytest.mark.parametrize("save_bytes", [0, None])  # recompute the logits / save onehot - p
@pytest.mark.parametrize("temperature", [0.6, 1.3])
def test_tempered_head_values_and_gradients_match_naive(temperature, save_bytes):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    hidden = jax.random.normal(k1, (3, 13, 16))
    w = jax.random.normal(k2, (16, 37)) * 0.5
    tokens = jax.random.randint(k3, (3, 13), 0, 37, jnp.int32)
    g = jax.random.normal(k4, tokens.shape)  # an arbitrary cotangent

    def ours(a, b):
        return token_logprobs(a, b, tokens, chunk=4, save_bytes=save_bytes, temperature=temperature)

    lp, ent = jax.jit(ours)(hidden, w)
    ref_lp, ref_ent = _naive(hidden, w, tokens, temperature)
    chex.assert_trees_all_close((lp, ent), (ref_lp, ref_ent), atol=1e-5, rtol=1e-5)
    plain, _ = _naive(hidden, w, tokens, 1.0)
    assert np.abs(np.asarray(plain - ref_lp)).max() > 0.1  # the temperature is really applied
    loss = lambda fn: lambda a, b: jnp.sum(g * fn(a, b)[0])  # noqa: E731
    got = jax.jit(jax.grad(loss(ours), (0, 1)))(hidden, w)
    ref = jax.grad(loss(lambda a, b: _naive(a, b, tokens, temperature)), (0, 1))(hidden, w)
    chex.assert_trees_all_close(got, ref, atol=1e-5, rtol=1e-5)


def test_the_trainer_temperature_is_derived_from_the_sampling_config():
    def exp(t, **kw):
        server = ServerConfig(return_original_logprob=kw.pop("original", False))
        sampling = SamplingParams(temperature=t, **kw)
        return ExperimentConfig(rollout=RolloutConfig(sampling=sampling), server=server)

    assert [exp(t).logprob_temperature for t in (0.6, 1.0, 1.3)] == [0.6, 1.0, 1.3]
    # The servers report untempered logprobs: the trainer scores at 1 (and with a gate,
    # that is only right when the tokens were sampled at 1 too).
    assert exp(1.0, original=True).logprob_temperature == 1.0


@pytest.mark.parametrize(
    ("sampling", "server", "gate", "field"),
    [
        (dict(temperature=0.0), {}, "binary_kl", "temperature = 0"),
        (dict(top_p=0.9), {}, "binary_kl", "top_p = 0.9"),
        (dict(top_k=20), {}, "ratio", "top_k = 20"),
        (dict(min_p=0.05), {}, "binary_kl", "min_p = 0.05"),
        (dict(temperature=0.6), dict(return_original_logprob=True), "binary_kl", "original"),
        (dict(repetition_penalty=1.1), {}, "none", "repetition_penalty = 1.1"),
        (dict(min_new_tokens=2), {}, "none", "min_new_tokens = 2"),
    ],
)
def test_combinations_the_trainer_cannot_score_are_refused(sampling, server, gate, field):
    with pytest.raises(ConfigError) as info:
        ExperimentConfig(
            rollout=RolloutConfig(sampling=SamplingParams(**sampling)),
            server=ServerConfig(**server),
            trainer=trainer_config(loss=dict(gate=gate)),
        )
    msg = str(info.value)
    assert "\n" not in msg and field in msg, msg


def test_truncated_or_greedy_sampling_is_accepted_without_a_gate():
    for sampling in (dict(top_p=0.9, top_k=20), dict(temperature=0.0)):
        exp = ExperimentConfig(
            rollout=RolloutConfig(sampling=SamplingParams(**sampling)),
            trainer=trainer_config(loss=dict(gate="none")),
        )
        assert exp.trainer.loss.gate == "none"


# --- against the embedded engine ------------------------------------------------------------
PROMPT_LEN, NEW, ROWS, T_PAD = 6, 14, 4, 32


def _rollout_batch(ckpt, temperature: float) -> tuple[Batch, ExperimentConfig]:
    """ROWS generations of the embedded engine at ``temperature``, packed as a train batch."""
    from osworld_jax.model import Qwen3MoeConfig
    from osworld_jax.rollout import SGLangClient
    from tests.rollout.conftest import serving, start_engine

    model = Qwen3MoeConfig.from_json(ckpt / "config.json")
    exp = ExperimentConfig(rollout=RolloutConfig(sampling=SamplingParams(temperature=temperature)))
    rollout = exp.rollout_for(model)  # R3 on: routes with the model's shape
    rng = np.random.default_rng(int(temperature * 10))
    prompts = [rng.integers(5, model.vocab_size - 5, PROMPT_LEN).tolist() for _ in range(ROWS)]

    async def main(url):
        async with SGLangClient([url], rollout) as client:
            return await asyncio.gather(
                *(
                    client.generate(
                        p,
                        exp.rollout.sampling.replace(
                            max_new_tokens=NEW, ignore_eos=True, sampling_seed=17 + i
                        ),
                    )
                    for i, p in enumerate(prompts)
                )
            )

    engine = start_engine(ckpt)
    try:

        async def serve_and_generate():
            async with serving(engine) as url:
                return await main(url)

        gens = asyncio.run(serve_and_generate())
    finally:
        engine.shutdown()
    L, K = model.num_hidden_layers, model.num_experts_per_tok
    z = lambda dtype: np.zeros((ROWS, T_PAD), dtype)  # noqa: E731
    tokens, mask, behavior, seg = z(np.int32), z(np.float32), z(np.float32), z(np.int32)
    routes = np.full((ROWS, T_PAD, L, K), -1, np.int32)
    for r, (p, g) in enumerate(zip(prompts, gens, strict=True)):
        n = PROMPT_LEN + len(g.output_ids)
        tokens[r, :n] = p + list(g.output_ids)
        mask[r, PROMPT_LEN:n] = 1.0
        behavior[r, PROMPT_LEN:n] = g.output_logprobs
        seg[r, :n] = 1
        routes[r, : n - 1] = g.routed_experts  # the route of each input position
    batch = Batch(
        tokens=tokens,
        loss_mask=mask,
        behavior_logprobs=behavior,
        advantages=mask * np.where(np.arange(ROWS) % 2, 1.0, -1.0)[:, None].astype(np.float32),
        positions=np.broadcast_to(np.arange(T_PAD, dtype=np.int32), (ROWS, T_PAD)).copy(),
        segment_ids=seg,
        owner_ids=np.arange(ROWS, dtype=np.int32),
        group_ids=np.zeros(ROWS, np.int32),
        row_weight=np.ones(ROWS, np.float32),
        routed_experts=routes,
    )
    return batch, exp


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.rollout.conftest import make_ckpt

    return make_ckpt(tmp_path_factory.mktemp("tiny"), seed=0)  # peaked: T matters


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.3])
def test_train_logprobs_equal_the_engines_at_its_temperature(ckpt, temperature):
    from osworld_jax.model import load_hf_checkpoint

    batch, exp = _rollout_batch(ckpt, temperature)
    policy = load_hf_checkpoint(ckpt, dtype=jnp.float32)
    bounds = BatchBounds(num_owners=ROWS, num_groups=1, norm_length=NEW)
    trainer = Trainer(trainer_config(), policy, bounds=bounds, temperature=exp.logprob_temperature)
    state = trainer.init_state()
    m = batch.loss_mask > 0
    ours = np.asarray(trainer.logprobs(state.params, batch))
    diff = np.abs(ours[m] - batch.behavior_logprobs[m])
    assert diff.max() <= 1e-5, diff.max()  # float32 engine and trainer
    if temperature != 1.0:  # scoring at T = 1 (the old behaviour) would not match
        plain = Trainer(trainer_config(), policy, bounds=bounds)
        off = np.asarray(plain.logprobs(state.params, batch))
        assert np.abs(off[m] - batch.behavior_logprobs[m]).mean() > 1e-2
    _, metrics = trainer.train_step(state, batch)  # on-policy: the binary-KL gate keeps all
    assert metrics["gate_rejected_fraction"] == 0.0
    assert metrics["logprob_abs_diff"] <= 1e-5 and metrics["binary_kl_mean"] < 1e-9
