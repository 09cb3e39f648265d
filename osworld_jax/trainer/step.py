"""The train step as a function: ``train_step(state, batch, old_logprobs, first_update)``.

`make_train_step` closes over the model's config, the loss and the optimizer and returns a pure
function of the `TrainState` and a device `Batch` (big_vision's ``train.py`` shape); `Trainer`
jits it once with explicit shardings and donation. One step:

1. token logprobs of the batch under the current parameters: the model room's pure
   ``forward(params, ...)`` (router replay from ``batch.routed_experts``) and the chunked
   log-softmax head (`osworld_jax.trainer.logprobs.token_logprobs`);
2. ``osworld_jax.algorithms.policy_loss`` under the configured `LossConfig`;
3. gradients accumulated over ``num_micro_batches`` micro-batches, then the optax update;
4. metrics; a non-finite loss or gradient norm skips the update in-graph (the caller raises).

Several updates per rollout batch (``TrainerConfig.num_minibatches``): pi_old of every
minibatch comes from a separate forward-only pass (`make_logprobs`) under the parameters before
the first update. That pass and the forward inside the gradient are two compiled programs, and
XLA keeps some bfloat16 intermediates in float32 ("excess precision") differently in each, so
their bfloat16 logprobs differ in the last bits (5e-4 per token on a tiny model at T = 128 on
the CPU; none in float32). The first update of a batch therefore passes ``first_update=True``:
the step takes pi_old itself as the **value** of pi and the gradient of its own forward,
``pi = v + (own - stop_gradient(own))`` with ``v = pi_old`` (``v = own`` on later updates:
exactly ``own``), so every ratio of the first update is exactly 1 and the gate decides on the
same pi_old as every later update. The flag is traced: one program for all updates of a batch.

Fixed bounds. Owner ids lie in ``[0, bounds.num_owners)`` (B x N) and group ids in
``[0, bounds.num_groups)`` (B): the aggregation counts only owners and groups that have loss
tokens, so a step with dropped groups or fewer owners is the same computation with some ids
unused, and the step compiles once per padded batch shape (length bucket), never per owner or
group count.

Global denominators under micro-batching. Every aggregation mode is linear in the per-token
loss: ``loss = sum_rt W_rt l_rt`` with weights ``W = d aggregate / d l`` that depend only on the
mask and the owner/group ids of the **whole** optimizer batch. ``W`` is computed once from the
full batch; each micro-batch then calls ``policy_loss`` in ``token-mean`` mode (weights
``w_rt = m_rt / sum m``) with advantages scaled by ``W / w`` (>= 0, so the gate, the importance
coefficients and PPO clipping are unchanged), which makes each micro-batch loss exactly its share
``sum_{rt in micro} W_rt l_rt`` and the accumulated gradient exactly the full-batch gradient.
Micro-batch ``i`` takes rows ``i, i + M, i + 2M, ...`` so every data shard holds an equal share.

Images (a Qwen3-VL policy): the batch's ``pixel_values`` [R, Np, P] and ``image_grid_thw``
[R, m, 3] are per row (made from a host batch's stored screenshots at the trainer's upload, per
device shard), so a micro-batch takes its rows' images with them; positions are the
M-RoPE [3, R, T] (split along their row axis, 1). The vision tower runs inside the same forward;
R3 replays the routes of image tokens like those of any other token.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from osworld_jax.algorithms import GATES, LossConfig, aggregate_loss, policy_loss
from osworld_jax.batch import BatchBounds
from osworld_jax.model import ModelRuntimeConfig, Qwen3MoeConfig, forward, unembed_matrix
from osworld_jax.trainer.config import TrainerConfig
from osworld_jax.trainer.logprobs import token_logprobs
from osworld_jax.trainer.optimizer import FROZEN, TRAIN
from osworld_jax.trainer.state import TrainState

Params = Any  # nested dict {group: {name: array}}
DeviceBatch = Any  # a `Batch` whose fields are jax arrays (inside jit); routes None without R3
Metrics = dict[str, jax.Array]


def split_micro(x: jax.Array, m: int) -> jax.Array:
    """``[R, ...] -> [M, R / M, ...]``; micro-batch i holds rows ``i, i + M, ...``."""
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def split_batch(batch: DeviceBatch, m: int) -> DeviceBatch:
    """`split_micro` of every field of ``batch``; M-RoPE positions [3, R, T] -> [M, 3, R/M, T]."""
    split = functools.partial(split_micro, m=m)
    positions = batch.positions
    if positions.ndim == 3:
        positions = jnp.swapaxes(split(jnp.swapaxes(positions, 0, 1)), 1, 2)
    else:
        positions = split(positions)
    rest = jax.tree.map(split, batch._replace(positions=None))
    return rest._replace(positions=positions)


def merge_micro(x: jax.Array) -> jax.Array:
    """Inverse of `split_micro`."""
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _masked_mean(x: jax.Array, weight: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(weight > 0, x * weight, 0.0)) / jnp.maximum(jnp.sum(weight), 1e-12)


def token_loss_weights(
    mask: jax.Array, batch: DeviceBatch, bounds: BatchBounds, agg_mode: str
) -> jax.Array:
    """``W = d aggregate_loss / d token_loss``: the weight of every token in the batch loss.

    Every aggregation mode is linear in the token losses, so ``aggregate(l) = sum W * l`` with
    ``W`` a function of the mask and ids only (e.g. ``m_rt / (G * T_g)`` for
    ``prompt-mean-token-mean``). Computed on the whole optimizer batch, these are the global
    denominators that every micro-batch shares.

    Args:
      mask: f32[R, T] loss mask (already multiplied by the row weights).
      batch: the batch (its ``owner_ids`` and ``group_ids`` are used).
      bounds: the id bounds and the ``seq-mean-token-sum-norm`` constant.
      agg_mode: a ``LOSS_AGG_MODES`` name.

    Returns:
      f32[R, T] non-negative token weights (0 off the mask).
    """

    def agg(token_loss: jax.Array) -> jax.Array:
        return aggregate_loss(
            token_loss,
            mask,
            mode=agg_mode,
            group_ids=batch.group_ids,
            num_groups=bounds.num_groups,
            owner_ids=batch.owner_ids,
            num_owners=bounds.num_owners,
            norm_length=bounds.norm_length,
        )

    return jax.grad(agg)(jnp.zeros_like(mask))


def micro_batch_policy_loss(
    logprobs: jax.Array,
    mb: DeviceBatch,
    weights: jax.Array,
    old_logprobs: jax.Array | None,
    loss: LossConfig,
    *,
    num_owners: int | None = None,
) -> jax.Array:
    """``sum_{rt in micro-batch} W_rt l_rt``: this micro-batch's exact share of the batch loss.

    Calls ``policy_loss`` in ``token-mean`` mode, whose token weights are
    ``w_rt = m_rt / sum_micro m``, with advantages scaled by ``W / w`` (``W`` from
    `token_loss_weights` on the whole batch). The scale is >= 0 and per token, so the gate and
    the importance coefficients (which do not look at advantages) and PPO clipping
    (``min(r A s, clip(r) A s) = s min(r A, clip(r) A)`` for ``s >= 0``) are unchanged; summed
    over micro-batches this equals ``policy_loss`` of the whole batch in ``loss.agg_mode``,
    value and gradient.

    Args:
      logprobs: f32[r, T] trainer logprobs of the micro-batch rows.
      mb: the micro-batch rows.
      weights: f32[r, T] the rows' slice of the full-batch weights ``W``.
      old_logprobs: f32[r, T] pi_old, or None (pi_old = stop_gradient(logprobs)).
      loss: gate and clipping settings (its ``agg_mode`` is already in ``weights``). An
        owner-level gate decides on these rows' owners alone: the whole batch must be one
        micro-batch (`_gate_owners_first` handles several).
      num_owners: the owner-id bound (owner-level gate).

    Returns:
      f32[] the micro-batch's loss share.
    """
    mask = mb.loss_mask * mb.row_weight[:, None]
    local = jax.grad(lambda t: aggregate_loss(t, mask, mode="token-mean"))(jnp.zeros_like(mask))
    scale = jnp.where(local > 0, weights / jnp.where(local > 0, local, 1.0), 0.0)
    value, _ = policy_loss(
        logprobs,
        mb.behavior_logprobs,
        jnp.where(local > 0, mb.advantages * scale, 0.0),
        mask,
        config=dataclasses.replace(loss, agg_mode="token-mean"),
        old_logprobs=old_logprobs,
        owner_ids=mb.owner_ids,  # the owner-level gate's unit (token-mean ignores them)
        num_owners=num_owners,
    )
    return value


class Scores(NamedTuple):
    """What the model says about some rows of a batch.

    Attributes:
      logprobs: f32[r, T] logprob of each token (aligned to ``tokens``; differentiable).
      entropy: f32[r, T] entropy of each predictive distribution (a stop-gradient metric).
      aux_loss: f32[] the coefficient-weighted router losses (``aux["total"]``).
      agreeing_routes: f32[] replayed (token, MoE layer) routes equal to the model's own top-k.
      replayed_routes: f32[] (token, MoE layer) pairs with a replayed route.
    """

    logprobs: jax.Array
    entropy: jax.Array
    aux_loss: jax.Array
    agreeing_routes: jax.Array
    replayed_routes: jax.Array


def compute_params(params: Params, runtime: ModelRuntimeConfig) -> Params:
    """The parameters in the model's compute dtype (master weights are cast differentiably)."""
    dtype = jnp.dtype(runtime.dtype)

    def cast(p: jax.Array) -> jax.Array:
        return p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p

    return jax.tree.map(cast, params)


def partition(params: Params, labels: Params | None) -> tuple[Params, Params]:
    """``(trainable, frozen)``: ``params`` split by ``labels``, None in the other's places.

    ``labels`` None: everything is trainable (the frozen tree is all None).
    """
    if labels is None:
        return params, jax.tree.map(lambda _: None, params)
    trainable = jax.tree.map(lambda lab, p: p if lab == TRAIN else None, labels, params)
    frozen = jax.tree.map(lambda lab, p: p if lab == FROZEN else None, labels, params)
    return trainable, frozen


def merge(trainable: Params, frozen: Params, labels: Params | None) -> Params:
    """The inverse of `partition`."""
    if labels is None:
        return trainable
    return jax.tree.map(lambda lab, t, f: t if lab == TRAIN else f, labels, trainable, frozen)


def serving_params(params: Params, dtype: Any) -> Params:
    """``params`` cast to a server's ``dtype`` on the device: the in-memory refit's payload.

    Every leaf is a new buffer (also where the dtype already matches), never one of the train
    state's own arrays, which the next train step donates; the layout is the parameters'
    (their shardings), so a server on the same devices takes them without a copy.
    """
    dt = jnp.dtype(dtype)

    def cast(p: jax.Array) -> jax.Array:
        if jnp.issubdtype(p.dtype, jnp.floating) and p.dtype != dt:
            return p.astype(dt)
        return jnp.array(p, copy=True)

    return jax.tree.map(cast, params)


def score_rows(
    params: Params,
    batch: DeviceBatch,
    *,
    model: Qwen3MoeConfig,
    runtime: ModelRuntimeConfig,
    config: TrainerConfig,
    temperature: float = 1.0,
) -> Scores:
    """Token logprobs, entropy, router losses and R3 agreement of some rows.

    The model room's pure ``forward`` on ``batch`` (routes replayed from
    ``batch.routed_experts`` when ``config.router_replay``; the rows' images through the vision
    tower when the batch has ``pixel_values``), then the chunked log-softmax head at
    ``temperature`` (the one the behaviour logprobs refer to).
    """
    params = compute_params(params, runtime)
    out = forward(
        params,
        model,
        runtime,
        batch.tokens,
        positions=batch.positions,
        segment_ids=batch.segment_ids,
        replay_experts=batch.routed_experts if config.router_replay else None,
        return_logits=False,
        pixel_values=batch.pixel_values,
        image_grid_thw=batch.image_grid_thw,
    )
    lp, ent = token_logprobs(
        out.hidden,
        unembed_matrix(params, model),
        batch.tokens,
        chunk=config.logprob_chunk,
        temperature=temperature,
        batch_axes=runtime.activation_batch_axes,
    )
    aux = out.aux
    return Scores(lp, ent, aux["total"], aux["agreeing_routes"], aux["replayed_routes"])


ScoreFn = Callable[[Params, DeviceBatch], Scores]


def _accumulate(
    params: Params,
    batch: DeviceBatch,
    old_logprobs: jax.Array | None,
    first_update: jax.Array | None = None,
    *,
    score: ScoreFn,
    runtime: ModelRuntimeConfig,
    loss: LossConfig,
    bounds: BatchBounds,
    num_micro_batches: int,
    labels: Params | None = None,
) -> tuple[Params, Scores, jax.Array]:
    """Gradient of the full-batch loss, summed over micro-batches (global denominators).

    Only the trainable partition of ``params`` is differentiated (``labels``: ``"frozen"``
    leaves enter the forward as constants, so ``jax.grad`` never builds their gradient, nor
    the backward of a frozen vision tower); a frozen leaf's entry of the returned gradient
    tree is a zero constant the optimizer's ``set_to_zero`` ignores and XLA removes.

    ``first_update`` (bool[] or None; only with ``old_logprobs``): when true, ``params`` are
    those ``old_logprobs`` were computed with, and the loss takes ``old_logprobs`` as the value
    of pi with the gradient of this forward (straight through): every ratio is exactly 1. When
    false (or None) pi is this forward's logprobs, bit for bit.

    Returns ``(grads, scores, policy_loss f32[])``: ``scores`` holds the merged ``[R, T]``
    logprobs / entropy, the mean aux loss and the summed route counts.
    """
    m = num_micro_batches
    mask = batch.loss_mask * batch.row_weight[:, None]  # [R, T]
    weights = token_loss_weights(mask, batch, bounds, loss.agg_mode)  # [R, T]
    split = functools.partial(split_micro, m=m)
    # Differentiate w.r.t. the compute-dtype copy the forward runs on (cast once, out of the
    # micro-batch loop): the same values as through the master -> compute cast, but every
    # per-micro-batch gradient tree is in the compute dtype (bf16), not the master's.
    compute = compute_params(params, runtime)
    trainable, frozen = partition(compute, labels)
    if loss.gate_level == "owner" and m > 1:
        batch, old_logprobs, loss = _gate_owners_first(
            compute, batch, old_logprobs, mask, score=score, loss=loss, bounds=bounds, m=m
        )
    old = None if old_logprobs is None else split(old_logprobs)
    micro = (split_batch(batch, m), split(weights), old)

    def micro_loss(p: Params, mb: DeviceBatch, w: jax.Array, o: jax.Array | None) -> Any:
        s = score(merge(p, frozen, labels), mb)
        if first_update is not None and o is not None:
            own = jax.lax.stop_gradient(s.logprobs)  # value: pi_old (first update) or own
            value = jnp.where(first_update, o, own)  # + 0 exactly; gradient: this forward's
            s = s._replace(logprobs=value + (s.logprobs - own))
        pl = micro_batch_policy_loss(s.logprobs, mb, w, o, loss, num_owners=bounds.num_owners)
        return pl + s.aux_loss / m, (pl, s)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
    if m == 1:  # no accumulator
        (_, out), grads = grad_fn(trainable, *jax.tree.map(lambda x: x[0], micro))
        pls, scores = jax.tree.map(lambda x: x[None], out)
    else:

        def body(acc: Params, xs: Any) -> tuple[Params, Any]:
            (_, out), g = grad_fn(trainable, *xs)
            return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, g), out

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), trainable)
        grads, (pls, scores) = jax.lax.scan(body, zeros, micro)
    masters, frozen_masters = partition(params, labels)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, masters)
    grads = merge(grads, jax.tree.map(jnp.zeros_like, frozen_masters), labels)
    merged = Scores(
        logprobs=merge_micro(scores.logprobs),
        entropy=merge_micro(scores.entropy),
        aux_loss=jnp.mean(scores.aux_loss),
        agreeing_routes=jnp.sum(scores.agreeing_routes),
        replayed_routes=jnp.sum(scores.replayed_routes),
    )
    return grads, merged, jnp.sum(pls)


def _gate_owners_first(
    compute: Params,
    batch: DeviceBatch,
    old_logprobs: jax.Array | None,
    mask: jax.Array,
    *,
    score: ScoreFn,
    loss: LossConfig,
    bounds: BatchBounds,
    m: int,
) -> tuple[DeviceBatch, jax.Array, LossConfig]:
    """The owner-level gate over the whole batch, before micro-batching splits owners apart.

    An owner's rows land in different micro-batches (rows ``i, i + M, ...``), but its decision
    pools all of them, so it is taken here on the full batch: pi_old of every row (one
    forward-only pass when ``old_logprobs`` is None: the extra cost of ``gate_level='owner'``
    with micro-batches), then the configured gate at owner level. The micro-batches then run
    gate ``'none'`` on advantages zeroed for the rejected owners: the same loss and gradient,
    since the gated token loss is ``-keep * exp(pi_old - mu) * ratio * A`` and a rejected
    owner's rows keep their masks, hence their denominators.

    Returns:
      ``(batch with rejected owners' advantages 0, pi_old f32[R, T], loss with gate 'none')``.
    """
    if old_logprobs is None:
        micro = split_batch(batch, m)
        lps = jax.lax.map(lambda mb: score(compute, mb).logprobs, micro)
        old_logprobs = jax.lax.stop_gradient(merge_micro(lps))
    keep, _ = GATES.get(loss.gate)(
        batch.behavior_logprobs,
        old_logprobs,
        mask,
        threshold=loss.gate_threshold,
        level="owner",
        owner_ids=batch.owner_ids,
        num_owners=bounds.num_owners,
    )  # bool[R], one decision per owner
    gated = batch._replace(advantages=jnp.where(keep[:, None], batch.advantages, 0.0))
    return gated, old_logprobs, dataclasses.replace(loss, gate="none", gate_level="sequence")


def _scorer(
    model: Qwen3MoeConfig, runtime: ModelRuntimeConfig, config: TrainerConfig, temperature: float
) -> ScoreFn:
    return functools.partial(
        score_rows, model=model, runtime=runtime, config=config, temperature=temperature
    )


def make_logprobs(
    model: Qwen3MoeConfig,
    runtime: ModelRuntimeConfig,
    config: TrainerConfig,
    temperature: float = 1.0,
) -> Callable[[Params, DeviceBatch], jax.Array]:
    """``logprobs(params, batch) -> f32[R, T]``: forward-only token logprobs (e.g. pi_old).

    The same micro-batching, chunking, router replay and temperature as the train step.
    """
    score = _scorer(model, runtime, config, temperature)
    m = config.num_micro_batches

    def logprobs(params: Params, batch: DeviceBatch) -> jax.Array:
        micro = split_batch(batch, m)
        return merge_micro(jax.lax.map(lambda mb: score(params, mb).logprobs, micro))

    return logprobs


def make_gradients(
    model: Qwen3MoeConfig,
    runtime: ModelRuntimeConfig,
    config: TrainerConfig,
    bounds: BatchBounds,
    temperature: float = 1.0,
    labels: Params | None = None,
) -> Callable[[Params, DeviceBatch], tuple[jax.Array, Params]]:
    """``gradients(params, batch) -> (loss, d loss / d params)`` exactly as the step has them.

    ``labels``: as `make_train_step`'s (frozen leaves' gradients are zeros, never computed).
    """
    accumulate = functools.partial(
        _accumulate,
        score=_scorer(model, runtime, config, temperature),
        runtime=runtime,
        loss=config.loss,
        bounds=bounds,
        num_micro_batches=config.num_micro_batches,
        labels=labels,
    )

    def gradients(params: Params, batch: DeviceBatch) -> tuple[jax.Array, Params]:
        grads, scores, pl = accumulate(params, batch, None)
        return pl + scores.aux_loss, grads

    return gradients


def make_train_step(
    *,
    model: Qwen3MoeConfig,
    runtime: ModelRuntimeConfig,
    config: TrainerConfig,
    bounds: BatchBounds,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    labels: Params,
    temperature: float = 1.0,
) -> Callable[..., tuple[TrainState, Metrics]]:
    """The train step of one policy, loss and optimizer, as a pure function.

    Args:
      model: the model's architecture (static).
      runtime: how the model computes (expert backend, dtype, remat).
      config: the trainer config (loss, micro-batching, logprob chunk, R3).
      bounds: owner / group id bounds and the ``seq-mean-token-sum-norm`` constant.
      tx: the optax optimizer.
      schedule: its learning-rate schedule (reported as the ``lr`` metric).
      labels: ``"trainable"`` / ``"frozen"`` per parameter: a frozen one gets no gradient
        (``jax.grad`` is taken w.r.t. the trainable partition only), leaves the grad norm and
        comes out of the step unchanged, bit for bit.
      temperature: the logits are divided by it before the log-softmax (logprobs, entropy,
        gate, loss): the temperature the batch's behaviour logprobs refer to.

    Returns:
      ``train_step(state, batch, old_logprobs=None, first_update=None) -> (state, metrics)``:
      ``old_logprobs`` f32[R, T] (pi_old of an earlier `make_logprobs` pass) or None (pi_old =
      this step's own logprobs under ``stop_gradient``: one optimizer step per rollout batch);
      ``first_update`` bool[] (with ``old_logprobs``): ``state.params`` are those pi_old was
      computed with, so pi's value is pi_old itself (every ratio exactly 1; the gradient is
      this forward's). Metrics are f32/i32 scalars: loss, policy_loss, aux_loss, grad_norm, lr,
      step, finite, the gate statistics of `policy_loss`, logprob_abs_diff, entropy, with R3
      route_agreement and, with ``old_logprobs``, ratio_mean and policy_shift (mean
      ``|pi - pi_old|`` over loss tokens).
    """
    accumulate = functools.partial(
        _accumulate,
        score=_scorer(model, runtime, config, temperature),
        runtime=runtime,
        loss=config.loss,
        bounds=bounds,
        num_micro_batches=config.num_micro_batches,
        labels=labels,
    )

    def train_step(
        state: TrainState,
        batch: DeviceBatch,
        old_logprobs: jax.Array | None = None,
        first_update: jax.Array | None = None,
    ) -> tuple[TrainState, Metrics]:
        grads, scores, pl = accumulate(state.params, batch, old_logprobs, first_update)
        loss = pl + scores.aux_loss
        trainable = jax.tree.map(lambda g, lab: g if lab == TRAIN else None, grads, labels)
        grad_norm = optax.global_norm(trainable)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        # A frozen leaf is the state's own array, bit for bit (not p + 0: -0.0 would become 0.0).
        params = jax.tree.map(
            lambda lab, p, u: p if lab == FROZEN else optax.apply_updates(p, u),
            labels,
            state.params,
            updates,
        )

        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep_new = lambda new, old: jnp.where(finite, new, old)
        new_state = TrainState(
            params=jax.tree.map(keep_new, params, state.params),
            opt_state=jax.tree.map(keep_new, opt_state, state.opt_state),
            step=state.step + finite.astype(jnp.int32),
            weight_version=state.weight_version + finite.astype(jnp.int32),
        )
        metrics = batch_metrics(batch, bounds, config.loss, old_logprobs, scores)
        if config.router_replay:
            metrics["route_agreement"] = scores.agreeing_routes / jnp.where(
                scores.replayed_routes > 0, scores.replayed_routes, jnp.nan
            )
        metrics |= {
            "loss": loss,
            "policy_loss": pl,
            "aux_loss": scores.aux_loss,
            "grad_norm": grad_norm,
            "lr": jnp.asarray(schedule(state.step), jnp.float32),
            "step": state.step,
            "finite": finite,
        }
        return new_state, metrics

    return train_step


def batch_metrics(
    batch: DeviceBatch,
    bounds: BatchBounds,
    loss: LossConfig,
    old_logprobs: jax.Array | None,
    scores: Scores,
) -> Metrics:
    """Gate/KL statistics of ``policy_loss`` on the full batch, entropy, |train - behaviour|."""
    mask = batch.loss_mask * batch.row_weight[:, None]
    lp = jax.lax.stop_gradient(scores.logprobs)
    _, pm = policy_loss(
        lp,
        batch.behavior_logprobs,
        batch.advantages,
        mask,
        config=loss,
        old_logprobs=old_logprobs,
        group_ids=batch.group_ids,
        num_groups=bounds.num_groups,
        owner_ids=batch.owner_ids,
        num_owners=bounds.num_owners,
        norm_length=bounds.norm_length,
    )
    finite_mask = jnp.where(jnp.isfinite(batch.behavior_logprobs), mask, 0.0)
    abs_diff = jnp.abs(lp - jnp.where(finite_mask > 0, batch.behavior_logprobs, lp))
    extra = {}
    if old_logprobs is not None:  # several updates per batch: how far pi moved from pi_old
        extra["ratio_mean"] = pm["ratio_mean"]
        extra["policy_shift"] = _masked_mean(jnp.abs(lp - old_logprobs), mask)
    return extra | {
        "gate_rejected_fraction": pm["gate_rejected_fraction"],
        "binary_kl_mean": pm["binary_kl_mean"],
        "is_weight_mean": pm["is_weight_mean"],
        "is_weight_max": pm["is_weight_max"],
        "clip_fraction": pm["clip_fraction"],
        "loss_tokens": pm["loss_tokens"],
        "logprob_abs_diff": _masked_mean(abs_diff, finite_mask),
        "entropy": _masked_mean(scores.entropy, mask),
    }
