"""The functional trainer: a jitted, sharded ``train_step(state, batch) -> (state, metrics)``.

One optimizer step (``Trainer.train_step``):

1. token logprobs of the batch under the current policy (router replay from
   ``batch.routed_experts``), chunked over the sequence (`logprobs.token_logprobs`);
2. ``osworld_jax.algorithms.policy_loss`` with the configured gate and aggregation;
3. gradients, accumulated over ``num_micro_batches`` micro-batches, then the optax update;
4. metrics; a non-finite loss or gradient skips the update in-graph and raises on the host.

Global denominators under micro-batching. Every aggregation mode is linear in the per-token
loss: ``loss = sum_rt W_rt l_rt`` with weights ``W = d aggregate / d l`` that depend only on the
mask and the owner/group ids of the **whole** optimizer batch. ``W`` is computed once from the
full batch; each micro-batch then calls ``policy_loss`` in ``token-mean`` mode (weights
``w_rt = m_rt / sum m``) with advantages scaled by ``W / w`` (>= 0, so the gate, the importance
coefficients and PPO clipping are unchanged), which makes each micro-batch loss exactly its share
``sum_{rt in micro} W_rt l_rt`` and the accumulated gradient exactly the full-batch gradient.

Sharding: parameters follow the model room's `ShardingRules`; optimizer moments follow their
parameters; batch rows are split over the rules' ``batch_axes``; the jitted functions are traced
and run under ``jax.set_mesh(mesh)`` so the model's activation constraints apply; micro-batch
``i`` takes rows ``i, i + M, i + 2M, ...`` so every data shard holds an equal share of each.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from osworld_jax.algorithms import aggregate_loss, policy_loss
from osworld_jax.batch import Batch, BatchMeta, check_batch
from osworld_jax.model import (
    ShardingRules,
    make_mesh,
    policy_shardings,
    router_param_labels,
    save_hf_checkpoint,
    validate_replay,
)
from osworld_jax.trainer.checkpoint import Checkpointer
from osworld_jax.trainer.config import TrainerConfig
from osworld_jax.trainer.logprobs import token_logprobs
from osworld_jax.trainer.memory import check_step_fits
from osworld_jax.trainer.optimizer import TRAIN, make_optimizer, make_schedule
from osworld_jax.trainer.state import NonFiniteError, TrainerError, TrainState

Params = Any  # nested dict {group: {name: array}}
DeviceBatch = Any  # a `Batch` whose fields are jax arrays (inside jit)


def _split_micro(x: jax.Array, m: int) -> jax.Array:
    """``[R, ...] -> [M, R / M, ...]``; micro-batch i holds rows ``i, i + M, ...``."""
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def _merge_micro(x: jax.Array) -> jax.Array:
    """Inverse of `_split_micro`."""
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _masked_mean(x: jax.Array, weight: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(weight > 0, x * weight, 0.0)) / jnp.maximum(jnp.sum(weight), 1e-12)


def token_loss_weights(
    mask: jax.Array, batch: DeviceBatch, meta: BatchMeta, agg_mode: str
) -> jax.Array:
    """``W = d aggregate_loss / d token_loss``: the weight of every token in the batch loss.

    Every aggregation mode is linear in the token losses, so ``aggregate(l) = sum W * l`` with
    ``W`` a function of the mask and ids only (e.g. ``m_rt / (G * T_g)`` for
    ``prompt-mean-token-mean``). Computed on the whole optimizer batch, these are the global
    denominators that every micro-batch shares.

    Args:
      mask: f32[R, T] loss mask (already multiplied by the row weights).
      batch: the batch (its ``owner_ids`` and ``group_ids`` are used).
      meta: the batch's static counts.
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
            num_groups=meta.num_groups,
            owner_ids=batch.owner_ids,
            num_owners=meta.num_owners,
            norm_length=meta.norm_length,
        )

    return jax.grad(agg)(jnp.zeros_like(mask))


def micro_batch_policy_loss(
    logprobs: jax.Array,
    mb: DeviceBatch,
    weights: jax.Array,
    old_logprobs: jax.Array | None,
    config: TrainerConfig,
) -> jax.Array:
    """``sum_{rt in micro-batch} W_rt l_rt``: this micro-batch's exact share of the batch loss.

    Calls ``policy_loss`` in ``token-mean`` mode, whose token weights are
    ``w_rt = m_rt / sum_micro m``, with advantages scaled by ``W / w`` (``W`` from
    `token_loss_weights` on the whole batch). The scale is >= 0 and per token, so the gate and
    the importance coefficients (which do not look at advantages) and PPO clipping
    (``min(r A s, clip(r) A s) = s min(r A, clip(r) A)`` for ``s >= 0``) are unchanged; summed
    over micro-batches this equals ``policy_loss`` of the whole batch in ``config.agg_mode``,
    value and gradient.

    Args:
      logprobs: f32[r, T] trainer logprobs of the micro-batch rows.
      mb: the micro-batch rows.
      weights: f32[r, T] the rows' slice of the full-batch weights ``W``.
      old_logprobs: f32[r, T] pi_old, or None (pi_old = stop_gradient(logprobs)).
      config: gate and clipping settings.

    Returns:
      f32[] the micro-batch's loss share.
    """
    mask = mb.loss_mask * mb.row_weight[:, None]
    local = jax.grad(lambda t: aggregate_loss(t, mask, mode="token-mean"))(jnp.zeros_like(mask))
    scale = jnp.where(local > 0, weights / jnp.where(local > 0, local, 1.0), 0.0)
    loss, _ = policy_loss(
        logprobs,
        mb.behavior_logprobs,
        jnp.where(local > 0, mb.advantages * scale, 0.0),
        mask,
        old_logprobs=old_logprobs,
        gate=config.gate,
        gate_threshold=config.gate_threshold,
        gate_level=config.gate_level,
        agg_mode="token-mean",
        ratio_clip=config.ratio_clip,
    )
    return loss


def _leaf_name(path: tuple[Any, ...]) -> str:
    last = path[-1]
    return str(getattr(last, "key", getattr(last, "name", last)))


class Trainer:
    """Holds the jitted train / logprob functions of one policy on one mesh.

    Usage::

      trainer = Trainer(config, policy, mesh=make_mesh(data=2, fsdp=2, tensor=2))
      state = trainer.init_state()
      state, metrics = trainer.train_step(state, batch, meta)   # metrics: host floats
      trainer.save(state, data_state=iterator)
      state, iterator = trainer.restore(data_iterator=iterator)
      trainer.export_hf(state, "/ckpt/hf")                      # refit SGLang from here

    Attributes:
      config: the trainer config.
      mesh: the device mesh (a 1-device mesh by default).
      rules: logical-axis -> mesh-axis rules of the parameters.
      tx: the optax optimizer.
      schedule: the learning-rate schedule.
      state_shardings: `TrainState` of ``NamedSharding``s (the jit in/out shardings).
      abstract_state: `TrainState` of ``jax.ShapeDtypeStruct`` (with shardings), from
        ``jax.eval_shape``.
    """

    def __init__(
        self,
        config: TrainerConfig,
        policy: nnx.Module,
        *,
        mesh: Mesh | None = None,
        rules: ShardingRules | None = None,
    ):
        """Builds shapes, shardings and the optimizer; compiles nothing yet.

        Args:
          config: the trainer config.
          policy: the policy module (concrete, or abstract from ``nnx.eval_shape`` when the
            parameters come from ``init_state(params=...)`` or ``init_state(init_fn=...)``).
          mesh: the device mesh with axes data/fsdp/expert/tensor (default: 1 device).
          rules: parameter sharding rules and the batch axes (default ``ShardingRules()``).
        """
        self.config = config
        self.mesh = mesh if mesh is not None else make_mesh()
        self.rules = rules or ShardingRules()
        graphdef, param_state, rest = nnx.split(policy, nnx.Param, ...)  # type: ignore[misc]
        self._graphdef: Any = graphdef
        if jax.tree.leaves(rest):
            raise TrainerError(
                "Trainer: the policy holds non-Param state "
                f"({sorted(str(p) for p, _ in jax.tree_util.tree_flatten_with_path(rest)[0])}); "
                "only nnx.Param state is supported"
            )
        self._rest = rest
        self._param_treedef = jax.tree.structure(param_state)
        self._policy_params = param_state.to_pure_dict()
        if jax.tree.leaves(self._policy_params) != jax.tree.leaves(param_state):
            raise TrainerError("Trainer: the policy's Param state does not flatten like its dict")
        self._model_config = getattr(policy, "config", None)
        self._runtime = getattr(policy, "runtime", None)

        self._batch_axes = tuple(a for a in self.rules.batch_axes if a in self.mesh.shape)
        self.data_parallel = math.prod(self.mesh.shape[a] for a in self._batch_axes)
        self._replicated = NamedSharding(self.mesh, PartitionSpec())
        self._row_sharding = NamedSharding(self.mesh, PartitionSpec(self._batch_axes or None))

        self._compute_dtypes = jax.tree.map(lambda x: jnp.dtype(x.dtype), self._policy_params)
        abstract_params = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, _master_dtype(x.dtype, config.master_dtype)),
            self._policy_params,
        )
        self._abstract_params = abstract_params
        self.param_shardings = policy_shardings(policy, self.mesh, self.rules).to_pure_dict()
        self._labels = router_param_labels(
            abstract_params, freeze_router=config.optimizer.freeze_router
        )
        decay_mask = jax.tree_util.tree_map_with_path(
            lambda p, x: not _leaf_name(p).endswith("norm") and x.ndim >= 2, abstract_params
        )
        labels = self._labels if config.optimizer.freeze_router else None
        self.tx = make_optimizer(config.optimizer, labels=labels, decay_mask=decay_mask)
        self.schedule = make_schedule(config.optimizer)

        abstract = jax.eval_shape(self._fresh_state, abstract_params, jnp.zeros((), jnp.int32))
        self.state_shardings = TrainState(
            params=self.param_shardings,
            opt_state=_follow_params(abstract.opt_state, self.param_shardings, self._replicated),
            step=self._replicated,
            rng=self._replicated,
            weight_version=self._replicated,
        )
        self.abstract_state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            abstract,
            self.state_shardings,
        )
        self._steps: dict[tuple[BatchMeta, bool], Callable] = {}
        self._grad_fns: dict[BatchMeta, Callable] = {}
        self._logprobs_fn = jax.jit(
            self._logprobs_impl,
            in_shardings=(self.param_shardings, self._batch_shardings()),
            out_shardings=self._row_sharding,
        )
        self._checkpointer: Checkpointer | None = None

    # ------------------------------------------------------------------ state

    def _fresh_state(self, params: Params, weight_version: jax.Array) -> TrainState:
        return TrainState(
            params=params,
            opt_state=self.tx.init(params),
            step=jnp.zeros((), jnp.int32),
            rng=jax.random.PRNGKey(self.config.seed),
            weight_version=jnp.asarray(weight_version, jnp.int32),
        )

    def init_state(
        self,
        params: Params | None = None,
        *,
        init_fn: Callable[[], nnx.Module] | None = None,
        weight_version: int = 0,
        donate: bool = False,
    ) -> TrainState:
        """A fresh train state on the mesh (parameters, zero optimizer state, step 0).

        Args:
          params: parameters as ``{group: {name: array}}`` (default: the constructor's policy).
          init_fn: instead of ``params``: builds a policy (e.g.
            ``lambda: Policy(cfg, rt, rngs=nnx.Rngs(0))``) whose parameters are created
            directly on device under ``jit`` with ``out_shardings`` (never whole on one device).
          weight_version: the version number of these weights.
          donate: hand the given parameter buffers over to the state (no copy; the policy's
            arrays are invalidated). Without it the state holds a copy.

        Returns:
          The `TrainState`, laid out as ``state_shardings``.
        """
        if init_fn is not None:
            params = jax.jit(
                lambda: self._to_master(nnx.state(init_fn(), nnx.Param).to_pure_dict()),
                out_shardings=self.param_shardings,
            )()
        else:
            if params is None:
                params = self._policy_params
            if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
                raise TrainerError("Trainer.init_state: abstract policy; pass params= or init_fn=")
            params = jax.jit(
                self._to_master,
                out_shardings=self.param_shardings,
                donate_argnums=(0,) if donate else (),
            )(params)
        rest = jax.jit(
            lambda p, v: self._fresh_state(p, v).replace(params=None),
            out_shardings=self.state_shardings.replace(params=None),
        )(params, np.int32(weight_version))
        return rest.replace(params=params)

    def policy(self, params: Params) -> Any:
        """The policy module over ``params`` (e.g. ``state.params``) in the policy's own dtype.

        Master weights are cast (differentiably) to the policy's parameter dtypes; parameters
        already in those dtypes are used as they are.
        """
        params = jax.tree.map(lambda p, d: p.astype(d), params, self._compute_dtypes)
        return nnx.merge(self._graphdef, self._as_nnx(params), self._rest)

    def _to_master(self, params: Params) -> Params:
        return jax.tree.map(lambda p, a: p.astype(a.dtype), params, self._abstract_params)

    def _as_nnx(self, params: Params) -> nnx.State:
        return jax.tree.unflatten(self._param_treedef, jax.tree.leaves(params))

    # ------------------------------------------------------------------ forward

    def _forward(
        self, params: Params, batch: DeviceBatch
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(logprobs f32[r, T], entropy f32[r, T], aux_loss f32[])`` of some rows."""
        model = self.policy(params)
        out = model(
            batch.tokens,
            positions=batch.positions,
            segment_ids=batch.segment_ids,
            replay_experts=batch.routed_experts if self.config.router_replay else None,
            return_logits=False,
        )
        lp, ent = token_logprobs(
            out.hidden, model.unembed(), batch.tokens, chunk=self.config.logprob_chunk
        )
        return lp, ent, out.aux["total"]

    def _logprobs_impl(self, params: Params, batch: DeviceBatch) -> jax.Array:
        m = self.config.num_micro_batches
        micro = jax.tree.map(functools.partial(_split_micro, m=m), batch)
        lps = jax.lax.map(lambda mb: self._forward(params, mb)[0], micro)
        return _merge_micro(lps)

    def logprobs(self, params: Params, batch: Batch) -> jax.Array:
        """Forward-only token logprobs f32[R, T] (aligned to ``batch.tokens``), e.g. pi_old.

        Uses the same micro-batching, chunking and router replay as the train step.
        """
        self._check_batch(batch)
        batch = self._device_batch(batch)
        with jax.set_mesh(self.mesh), jax.transfer_guard("disallow"):
            return self._logprobs_fn(params, batch)

    # ------------------------------------------------------------------ train step

    def _micro_loss(
        self,
        params: Params,
        mb: DeviceBatch,
        weights: jax.Array,
        old_logprobs: jax.Array | None,
    ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """The micro-batch's exact share of the full-batch loss, plus its aux loss share."""
        lp, ent, aux = self._forward(params, mb)
        pl = micro_batch_policy_loss(lp, mb, weights, old_logprobs, self.config)
        return pl + aux / self.config.num_micro_batches, (pl, aux, lp, ent)

    def _accumulate(
        self,
        params: Params,
        batch: DeviceBatch,
        meta: BatchMeta,
        old_logprobs: jax.Array | None,
    ) -> tuple[Params, tuple[jax.Array, ...]]:
        """Gradient of the full-batch loss, summed over micro-batches (global denominators).

        Returns ``(grads, (policy_losses f32[M], aux_losses f32[M], logprobs f32[R, T],
        entropy f32[R, T]))``.
        """
        m = self.config.num_micro_batches
        mask = batch.loss_mask * batch.row_weight[:, None]  # [R, T]
        weights = token_loss_weights(mask, batch, meta, self.config.agg_mode)  # [R, T]
        split = functools.partial(_split_micro, m=m)
        old = None if old_logprobs is None else split(old_logprobs)
        micro = (jax.tree.map(split, batch), split(weights), old)
        grad_fn = jax.value_and_grad(self._micro_loss, has_aux=True)
        # Differentiate w.r.t. the policy-dtype copy the forward computes with (cast once, out
        # of the micro-batch loop): the same values as through the master->compute cast, but
        # every per-micro-batch gradient tree is in the compute dtype (bf16), not the master's.
        compute = jax.tree.map(lambda p, d: p.astype(d), params, self._compute_dtypes)

        if m == 1:  # no accumulator
            (_, out), grads = grad_fn(compute, *jax.tree.map(lambda x: x[0], micro))
            pls, auxs, lps, ents = jax.tree.map(lambda x: x[None], out)
        else:

            def body(acc: Params, xs: Any) -> tuple[Params, Any]:
                (_, out), g = grad_fn(compute, *xs)
                return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, g), out

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
            grads, (pls, auxs, lps, ents) = jax.lax.scan(body, zeros, micro)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        return grads, (pls, auxs, _merge_micro(lps), _merge_micro(ents))

    def _gradients_impl(
        self, meta: BatchMeta, params: Params, batch: DeviceBatch
    ) -> tuple[jax.Array, Params]:
        grads, (pls, auxs, _, _) = self._accumulate(params, batch, meta, None)
        return jnp.sum(pls) + jnp.mean(auxs), grads

    def gradients(self, params: Params, batch: Batch, meta: BatchMeta) -> tuple[jax.Array, Params]:
        """``(loss, d loss / d params)`` exactly as the train step computes them (no update).

        For diagnostics and tests: the same micro-batching, denominators and sharding.
        """
        self._check_batch(batch)
        batch = self._device_batch(batch)
        if meta not in self._grad_fns:
            self._grad_fns[meta] = jax.jit(
                functools.partial(self._gradients_impl, meta),
                in_shardings=(self.param_shardings, self._batch_shardings()),
                out_shardings=(self._replicated, self.param_shardings),
            )
        with jax.set_mesh(self.mesh), jax.transfer_guard("disallow"):
            return self._grad_fns[meta](params, batch)

    def _train_step_impl(
        self,
        meta: BatchMeta,
        state: TrainState,
        batch: DeviceBatch,
        old_logprobs: jax.Array | None,
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        mask = batch.loss_mask * batch.row_weight[:, None]  # [R, T]
        grads, (pls, auxs, lps, ents) = self._accumulate(state.params, batch, meta, old_logprobs)
        policy_loss_value = jnp.sum(pls)
        aux_loss = jnp.mean(auxs)
        loss = policy_loss_value + aux_loss
        trainable = jax.tree.map(lambda g, lab: g if lab == TRAIN else None, grads, self._labels)
        grad_norm = optax.global_norm(trainable)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)

        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep_new = lambda new, old: jnp.where(finite, new, old)
        new_state = TrainState(
            params=jax.tree.map(keep_new, params, state.params),
            opt_state=jax.tree.map(keep_new, opt_state, state.opt_state),
            step=state.step + finite.astype(jnp.int32),
            rng=state.rng,
            weight_version=state.weight_version + finite.astype(jnp.int32),
        )
        metrics = self._metrics(batch, meta, mask, old_logprobs, lps, ents)
        metrics |= {
            "loss": loss,
            "policy_loss": policy_loss_value,
            "aux_loss": aux_loss,
            "grad_norm": grad_norm,
            "lr": jnp.asarray(self.schedule(state.step), jnp.float32),
            "step": state.step,
            "finite": finite,
        }
        return new_state, metrics

    def _metrics(
        self,
        batch: DeviceBatch,
        meta: BatchMeta,
        mask: jax.Array,
        old_logprobs: jax.Array | None,
        logprobs: jax.Array,
        entropy: jax.Array,
    ) -> dict[str, jax.Array]:
        """Gate/KL statistics of ``policy_loss`` on the full batch, entropy, |train - behaviour|."""
        cfg = self.config
        lp = jax.lax.stop_gradient(logprobs)
        _, pm = policy_loss(
            lp,
            batch.behavior_logprobs,
            batch.advantages,
            mask,
            old_logprobs=old_logprobs,
            gate=cfg.gate,
            gate_threshold=cfg.gate_threshold,
            gate_level=cfg.gate_level,
            agg_mode=cfg.agg_mode,
            ratio_clip=cfg.ratio_clip,
            group_ids=batch.group_ids,
            num_groups=meta.num_groups,
            owner_ids=batch.owner_ids,
            num_owners=meta.num_owners,
            norm_length=meta.norm_length,
        )
        finite_mask = jnp.where(jnp.isfinite(batch.behavior_logprobs), mask, 0.0)
        abs_diff = jnp.abs(lp - jnp.where(finite_mask > 0, batch.behavior_logprobs, lp))
        return {
            "gate_rejected_fraction": pm["gate_rejected_fraction"],
            "binary_kl_mean": pm["binary_kl_mean"],
            "is_weight_mean": pm["is_weight_mean"],
            "clip_fraction": pm["clip_fraction"],
            "loss_tokens": pm["loss_tokens"],
            "logprob_abs_diff": _masked_mean(abs_diff, finite_mask),
            "entropy": _masked_mean(entropy, mask),
        }

    def _compiled_step(self, meta: BatchMeta, with_old: bool) -> Callable:
        key = (meta, with_old)
        if key not in self._steps:
            old_sharding = self._row_sharding if with_old else None
            self._steps[key] = jax.jit(
                functools.partial(self._train_step_impl, meta),
                in_shardings=(self.state_shardings, self._batch_shardings(), old_sharding),
                out_shardings=(self.state_shardings, self._replicated),
                donate_argnums=0,
            )
        return self._steps[key]

    def train_step(
        self,
        state: TrainState,
        batch: Batch,
        meta: BatchMeta,
        old_logprobs: Any = None,
    ) -> tuple[TrainState, dict[str, float]]:
        """One optimizer step over the whole ``batch`` (micro-batched as configured).

        ``state`` is donated: use only the returned state afterwards. Compiles once per
        ``(shapes, meta, old_logprobs given)`` bucket. Runs under
        ``jax.transfer_guard("disallow")``; the only transfers are the explicit batch upload
        and the metrics download.

        Args:
          state: the current train state (laid out as ``state_shardings``).
          batch: the padded batch (numpy or device arrays); rows divide by
            ``num_micro_batches * data_parallel``.
          meta: the batch's static counts (part of the compiled bucket).
          old_logprobs: f32[R, T] pi_old from `logprobs` when a rollout batch is used for more
            than one update; None: pi_old = the current policy (ratio 1).

        Returns:
          ``(new_state, metrics)``; metrics are host floats: loss, policy_loss, aux_loss,
          grad_norm, lr, gate_rejected_fraction, binary_kl_mean, is_weight_mean, clip_fraction,
          loss_tokens, logprob_abs_diff (mean |train - behaviour| logprob on loss tokens),
          entropy (mean on loss tokens), step.

        Raises:
          NonFiniteError: the loss or gradient norm is NaN/Inf (names the step; the update
            was skipped, the returned-by-exception state is unchanged).
        """
        self._check_batch(batch)
        batch = self._device_batch(batch)
        if old_logprobs is not None:
            old_logprobs = jax.device_put(old_logprobs, self._row_sharding)
        if (meta, old_logprobs is not None) not in self._steps:
            self.check_memory(*batch.tokens.shape)  # before compiling the new bucket
        step_fn = self._compiled_step(meta, old_logprobs is not None)
        with jax.set_mesh(self.mesh), jax.transfer_guard("disallow"):
            state, metrics = step_fn(state, batch, old_logprobs)
        host = {k: v.item() for k, v in jax.device_get(metrics).items()}
        finite = host.pop("finite")
        host["step"] = int(host["step"])
        if self.config.check_finite and not finite:
            raise NonFiniteError(host["step"], host, state=state)
        return state, host

    def check_memory(self, rows: int, seq: int, capacity: float | None = None) -> Any:
        """Estimated per-device bytes of a step on ``rows x seq`` (`memory.check_step_fits`).

        Raises `TrainerError` naming what to change when the estimate exceeds the device's
        memory (``capacity``: default the device allocator's limit; unknown on CPU: no check).
        """
        if self._model_config is None or self._runtime is None:
            return None
        shape = self.mesh.shape
        shards = math.prod(shape.get(a, 1) for a in ("fsdp", "expert", "tensor"))
        return check_step_fits(
            self._model_config,
            self._runtime,
            self.config,
            rows=rows,
            seq=seq,
            param_shards=shards,
            batch_shards=self.data_parallel,
            capacity=capacity,
        )

    # ------------------------------------------------------------------ batch plumbing

    def _batch_shardings(self) -> DeviceBatch:
        sh = self._row_sharding
        return Batch._make([sh] * 9 + [sh if self.config.router_replay else None])

    def _device_batch(self, batch: Batch) -> DeviceBatch:
        fields: list[Any] = list(batch)
        if not self.config.router_replay:
            fields[-1] = None  # R3 off: the routes are not uploaded at all
        return jax.device_put(Batch._make(fields), self._batch_shardings())

    def _check_batch(self, batch: Batch) -> None:
        check_batch(batch)
        rows = batch.tokens.shape[0]
        need = self.config.num_micro_batches * self.data_parallel
        if rows % need:
            raise TrainerError(
                f"Batch.tokens: {rows} rows do not divide by num_micro_batches "
                f"({self.config.num_micro_batches}) x data-parallel size ({self.data_parallel})"
            )
        c = self._model_config
        if (
            self.config.router_replay
            and c is not None
            and isinstance(batch.routed_experts, np.ndarray)
        ):
            validate_replay(batch.routed_experts, c)  # host-side; raises RouterReplayError

    # ------------------------------------------------------------------ checkpoints, export

    @property
    def checkpointer(self) -> Checkpointer:
        """The checkpoint manager of ``config.checkpoint`` (created on first use)."""
        if self._checkpointer is None:
            self._checkpointer = Checkpointer(self.config.checkpoint)
        return self._checkpointer

    def save(
        self, state: TrainState, step: int | None = None, data_state: Any = None, *, force=False
    ) -> bool:
        """Checkpoints ``state`` (and the data-iterator state) if ``step`` is on the cadence.

        ``step`` defaults to ``state.step``. Async saves are awaited by `close` / `restore`.
        """
        if step is None:
            step = int(jax.device_get(state.step))
        return self.checkpointer.save(state, step, data_state, force=force)

    def restore(
        self, step: int | None = None, *, data_iterator: Any = None
    ) -> tuple[TrainState, Any]:
        """Restores checkpoint ``step`` (default latest) onto this trainer's mesh and shardings.

        Returns ``(state, data_state)`` (see `Checkpointer.restore`).
        """
        return self.checkpointer.restore(
            self.abstract_state, step=step, data_iterator=data_iterator
        )

    def export_hf(
        self, state: TrainState, path: str | Path, *, copy_files_from: str | Path | None = None
    ) -> Path:
        """Writes ``state.params`` as a HF checkpoint for an SGLang refit.

        Goes through ``osworld_jax.model.save_hf_checkpoint`` (atomic: a temporary directory
        renamed onto ``path``). ``copy_files_from`` (e.g. the base checkpoint) supplies the
        tokenizer files.
        """
        return save_hf_checkpoint(self.policy(state.params), path, copy_files_from=copy_files_from)

    def close(self) -> None:
        """Waits for in-flight checkpoint saves (call before exit)."""
        if self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _master_dtype(dtype: Any, master: str | None) -> Any:
    """The train-state dtype of a parameter of ``dtype`` (floating parameters only)."""
    if master is None or not jnp.issubdtype(dtype, jnp.floating):
        return dtype
    return jnp.dtype(master)


def _follow_params(opt_state: Any, param_shardings: Params, default: NamedSharding) -> Any:
    """Shardings for an optax state: parameter-shaped leaves follow their parameter.

    A leaf whose key path ends with a parameter's key path (Adam's ``mu``/``nu``) gets that
    parameter's sharding; everything else (counts, ...) is replicated.
    """
    by_path = {
        tuple(path): sh for path, sh in jax.tree_util.tree_flatten_with_path(param_shardings)[0]
    }
    depth = max(len(p) for p in by_path)

    def pick(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> NamedSharding:
        for k in range(min(depth, len(path)), 0, -1):
            sh = by_path.get(tuple(path[-k:]))
            if sh is not None and len(sh.spec) <= leaf.ndim:
                return sh
        return default

    return jax.tree_util.tree_map_with_path(pick, opt_state)
