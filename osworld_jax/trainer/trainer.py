"""`Trainer`: holds the train state's layout and calls the jitted step (`trainer.step`).

The math lives in `osworld_jax.trainer.step` (``make_train_step`` over the model room's pure
``forward``); this class builds the optimizer, the shardings and the abstract state once, jits
the step with explicit in/out shardings and donation, uploads batches, and owns checkpointing
and HF export.

Sharding: parameters follow the model room's `ShardingRules`; optimizer moments follow their
parameters; batch rows are split over the rules' ``batch_axes`` (axis 0 of every field, axis 1
of the M-RoPE positions [3, R, T]; a row's images travel with it: a host batch's stored
screenshots become float32 patches per device shard at upload); the jitted functions run
under ``jax.set_mesh(mesh)`` so the model's activation constraints apply. The step is jitted
once per batch layout (text, or with images) and compiles once per padded shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from osworld_jax.batch import Batch, BatchBounds, check_batch
from osworld_jax.model import (
    Policy,
    ShardingRules,
    make_mesh,
    param_labels,
    param_shardings,
    save_hf_checkpoint,
    validate_replay,
)
from osworld_jax.model.params import decay_mask
from osworld_jax.trainer.checkpoint import Checkpointer
from osworld_jax.trainer.config import TrainerConfig
from osworld_jax.trainer.distributed import collective
from osworld_jax.trainer.images import device_pixel_values
from osworld_jax.trainer.layout import follow_params, master_dtype_of
from osworld_jax.trainer.memory import check_step_fits
from osworld_jax.trainer.optimizer import FROZEN, make_optimizer, make_schedule
from osworld_jax.trainer.state import NonFiniteError, TrainerError, TrainState
from osworld_jax.trainer.step import (
    compute_params,
    make_gradients,
    make_logprobs,
    make_train_step,
    serving_params,
)

Params = Any  # nested dict {group: {name: array}}


def _paths(tree: Any) -> list[Any]:
    return [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _param_dict(policy: Policy) -> Params:
    """The policy's ``nnx.Param`` values as ``{group: {name: array}}`` (abstract ones too)."""
    state = nnx.state(policy, nnx.Param).to_pure_dict()
    return {group: names for group, names in state.items() if names}


class Trainer:
    """The train state's layout, the jitted step, checkpoints and export of one policy.

    Usage::

      trainer = Trainer(config, policy, bounds=BatchBounds(num_owners=64, num_groups=8,
                        norm_length=4096), mesh=make_mesh(data=2, fsdp=2, tensor=2))
      state = trainer.init_state()
      state, metrics = trainer.train_step(state, batch)          # metrics: host floats
      trainer.save(state, data_state=iterator)
      state, iterator = trainer.restore(data_iterator=iterator)
      trainer.export_hf(state, "/ckpt/hf")                       # refit SGLang from here

    Attributes:
      config: the trainer config.
      bounds: the owner / group id bounds and the norm length every batch is trained under
        (fixed: the step compiles once per padded batch shape).
      temperature: the temperature of every logprob the trainer computes (that of the
        behaviour logprobs).
      model: the policy's architecture.
      runtime: how the policy computes.
      mesh: the device mesh (a 1-device mesh by default).
      rules: logical-axis -> mesh-axis rules of the parameters.
      data_parallel: the number of shards batch rows are split into.
      tx: the optax optimizer.
      schedule: the learning-rate schedule.
      param_shardings: ``{group: {name: NamedSharding}}`` of the parameters.
      state_shardings: `TrainState` of ``NamedSharding``s (the jit in/out shardings).
      abstract_state: `TrainState` of ``jax.ShapeDtypeStruct`` (with shardings), from
        ``jax.eval_shape``.
    """

    def __init__(
        self,
        config: TrainerConfig,
        policy: Policy,
        *,
        bounds: BatchBounds,
        temperature: float = 1.0,
        mesh: Mesh | None = None,
        rules: ShardingRules | None = None,
    ):
        """Builds shapes, shardings, the optimizer and the jitted functions; compiles nothing.

        Args:
          config: the trainer config.
          policy: the policy module (concrete, or abstract from ``nnx.eval_shape`` when the
            parameters come from ``init_state(params=...)`` or ``init_state(init_fn=...)``);
            its ``config`` and ``runtime`` define the model the step runs.
          bounds: owner / group id bounds and the ``seq-mean-token-sum-norm`` constant.
          temperature: the temperature the batches' behaviour logprobs refer to (a run derives
            it from the sampling config: ``ExperimentConfig.logprob_temperature``); every
            logprob the trainer computes (gate, loss, metrics, `logprobs`) is at it. > 0.
          mesh: the device mesh with axes data/fsdp/expert/tensor (default: 1 device).
          rules: parameter sharding rules and the batch axes (default ``ShardingRules()``).
        """
        if not temperature > 0:
            raise TrainerError(f"Trainer: temperature must be > 0, got {temperature}")
        self.config, self.bounds, self.temperature = config, bounds, float(temperature)
        self.model, self.runtime = policy.config, policy.runtime
        self._policy_type = type(policy)
        self.mesh = mesh if mesh is not None else make_mesh()
        self.rules = rules or ShardingRules()
        self._policy_params = _param_dict(policy)
        self.param_shardings = param_shardings(self.model, self.mesh, self.rules)
        if _paths(self._policy_params) != _paths(self.param_shardings):
            raise TrainerError("Trainer: the policy's parameters do not match its config's")
        batch_axes = tuple(a for a in self.rules.batch_axes if a in self.mesh.shape)
        self.data_parallel = int(np.prod([self.mesh.shape[a] for a in batch_axes]))
        self._replicated = NamedSharding(self.mesh, PartitionSpec())
        self._rows = NamedSharding(self.mesh, PartitionSpec(batch_axes or None))
        self._rows_axis1 = NamedSharding(self.mesh, PartitionSpec(None, batch_axes or None))

        opt = config.optimizer
        labels = param_labels(
            self._policy_params,
            freeze_router=opt.freeze_router,
            freeze_vision=opt.freeze_vision,
        )
        # A frozen parameter is held once, in the policy's dtype: no master copy (it is never
        # updated), no optimizer state, no gradient (`step.partition`).
        self._abstract_params = jax.tree.map(
            lambda x, lab: jax.ShapeDtypeStruct(
                x.shape, master_dtype_of(x.dtype, None if lab == FROZEN else config.master_dtype)
            ),
            self._policy_params,
            labels,
        )
        freezes = opt.freeze_router or opt.freeze_vision
        self.labels = labels if freezes else None
        self.tx = make_optimizer(
            opt,
            labels=self.labels,
            decay_mask=decay_mask(self.model),  # matrices only; stacked norms/biases are vectors
        )
        self.schedule = make_schedule(config.optimizer)

        abstract = jax.eval_shape(self._fresh_state, self._abstract_params, 0)
        self.state_shardings = TrainState(
            params=self.param_shardings,
            opt_state=follow_params(abstract.opt_state, self.param_shardings, self._replicated),
            step=self._replicated,
            weight_version=self._replicated,
        )
        self.abstract_state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            abstract,
            self.state_shardings,
        )
        self._step_fn = make_train_step(
            model=self.model,
            runtime=self.runtime,
            config=config,
            bounds=bounds,
            tx=self.tx,
            schedule=self.schedule,
            labels=labels,
            temperature=self.temperature,
        )
        self._logprobs_fn = make_logprobs(self.model, self.runtime, config, self.temperature)
        self._gradients_fn = make_gradients(
            self.model, self.runtime, config, bounds, self.temperature, labels=self.labels
        )
        self._jitted: dict[tuple[str, ...], tuple[Any, Any, Any]] = {}
        self._checked_shapes: set[tuple[tuple[int, ...], int]] = set()  # (R, T), patches
        self._checkpointer: Checkpointer | None = None

    # ------------------------------------------------------------------ state

    def _fresh_state(self, params: Params, weight_version: Any) -> TrainState:
        return TrainState(
            params=params,
            opt_state=self.tx.init(params),
            step=jnp.zeros((), jnp.int32),
            weight_version=jnp.asarray(weight_version, jnp.int32),
        )

    def _to_master(self, params: Params) -> Params:
        return jax.tree.map(lambda p, a: p.astype(a.dtype), params, self._abstract_params)

    def init_state(
        self,
        params: Params | None = None,
        *,
        init_fn: Callable[[], Policy] | None = None,
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
                lambda: self._to_master(_param_dict(init_fn())),
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
        """A policy module viewing ``params`` (e.g. ``state.params``) in the compute dtype.

        For export and inspection; the train step itself runs the pure ``forward``.
        """
        view = nnx.eval_shape(lambda: self._policy_type(self.model, self.runtime, rngs=nnx.Rngs(0)))
        nnx.update(view, compute_params(params, self.runtime))
        return view

    def serving_params(self, state: TrainState, dtype: Any) -> Params:
        """``state.params`` cast for a server on the device (`step.serving_params`)."""
        return serving_params(state.params, dtype)

    def batch_shardings(self, batch: Batch) -> Batch:
        """A `Batch` of the shardings its fields take (None where the field is None).

        Rows are split over the batch axes: axis 0 of every field, axis 1 of the M-RoPE
        positions [3, R, T].
        """
        fields: dict[str, Any] = {}
        for name in Batch._fields:
            value = getattr(batch, name)
            if name == "pixel_values" and batch.images is not None:
                fields[name] = self._rows  # made from the stored images at upload
            elif value is None or name == "images":
                fields[name] = None
            elif name == "positions" and np.ndim(value) == 3:
                fields[name] = self._rows_axis1
            else:
                fields[name] = self._rows
        return Batch(**fields)

    def _functions(self, shardings: Batch) -> tuple[Any, Any, Any]:
        """(train_step, logprobs, gradients) jitted for one batch layout (cached)."""
        key = tuple(
            "-" if sh is None else ("1" if sh is self._rows_axis1 else "0") for sh in shardings
        )
        if key not in self._jitted:
            self._jitted[key] = (
                jax.jit(
                    self._step_fn,
                    in_shardings=(self.state_shardings, shardings, self._rows, self._replicated),
                    out_shardings=(self.state_shardings, self._replicated),
                    donate_argnums=0,
                ),
                jax.jit(
                    self._logprobs_fn,
                    in_shardings=(self.param_shardings, shardings),
                    out_shardings=self._rows,
                ),
                jax.jit(
                    self._gradients_fn,
                    in_shardings=(self.param_shardings, shardings),
                    out_shardings=(self._replicated, self.param_shardings),
                ),
            )
        return self._jitted[key]

    def jitted_step(self, batch: Batch) -> tuple[Any, Any]:
        """``(jitted train step for batch's layout, the uploaded batch)``, e.g. to lower it.

        The jitted step takes ``(state, batch, old_logprobs, first_update)``; the one-update
        step (the recipes') is ``fn.lower(abstract_state, batch, None, None)``.
        """
        device, shardings = self._device_batch(batch)
        return self._functions(shardings)[0], device

    def lower(self, program: str, batch: Batch, *, old_logprobs: bool = False) -> Any:
        """The jitted ``"train_step"`` or ``"logprobs"`` lowered for an abstract device batch.

        ``batch`` holds ``jax.ShapeDtypeStruct`` fields (`program_memory.abstract_batch`); they
        take `batch_shardings` and the step takes ``abstract_state``, under the trainer's mesh,
        exactly as `train_step` / `logprobs` call the same jitted functions: the compiled
        program is the run's (a persistent compilation cache hands it to the first real call).
        ``old_logprobs``: the step's form with pi_old (``num_minibatches > 1``).
        """
        shardings = self.batch_shardings(batch)
        fns = self._functions(shardings)
        args = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), batch, shardings
        )
        rows = batch.tokens.shape
        with jax.set_mesh(self.mesh):
            if program == "logprobs":
                return fns[1].lower(self.abstract_state.params, args)
            if program != "train_step":
                raise TrainerError(f"Trainer.lower: unknown program {program!r}")
            old = first = None
            if old_logprobs:
                old = jax.ShapeDtypeStruct(rows, jnp.float32, sharding=self._rows)
                first = jax.ShapeDtypeStruct((), jnp.bool_, sharding=self._replicated)
            return fns[0].lower(self.abstract_state, args, old, first)

    @collective("logprobs")  # multi-host: bounded, named (trainer.distributed)
    def logprobs(self, params: Params, batch: Batch) -> jax.Array:
        """Forward-only token logprobs f32[R, T] (aligned to ``batch.tokens``), e.g. pi_old.

        Uses the same micro-batching, chunking and router replay as the train step. In
        bfloat16 the values may differ from the train step's own in the last bits (another
        compiled program); `train_minibatches` makes that invisible to the first update.
        """
        batch, shardings = self._device_batch(batch)
        with jax.set_mesh(self.mesh), jax.transfer_guard("disallow"):
            return self._functions(shardings)[1](params, batch)

    def gradients(self, params: Params, batch: Batch) -> tuple[jax.Array, Params]:
        """``(loss, d loss / d params)`` exactly as the train step computes them (no update).

        For diagnostics and tests: the same micro-batching, denominators and sharding.
        """
        batch, shardings = self._device_batch(batch)
        with jax.set_mesh(self.mesh), jax.transfer_guard("disallow"):
            return self._functions(shardings)[2](params, batch)

    def train_minibatches(
        self, state: TrainState, batches: Sequence[Batch]
    ) -> tuple[TrainState, list[dict[str, float]]]:
        """One optimizer update per minibatch of one rollout batch (``num_minibatches``).

        One minibatch is exactly ``train_step(state, batches[0])`` (pi_old = the step's own
        logprobs; the recipes' step, bit for bit). With several (PPO's epochs over
        minibatches, one epoch): pi_old of **every** minibatch is computed first, by `logprobs`
        under ``state.params`` (before any update); update ``i`` then trains on
        ``batches[i]`` from the parameters of update ``i - 1`` with that pi_old in the gate,
        the importance weights ``exp(pi_old - mu)`` and the ratios ``exp(pi - pi_old)``. The
        first update passes ``first_update=True``: its parameters are pi_old's, so pi's value
        is pi_old itself and every ratio is exactly 1 (the two compiled programs may round
        bfloat16 differently). Each update normalises its loss over its own minibatch (its
        owners, groups and tokens), as PPO / verl / slime minibatches do.

        Args:
          state: the train state (donated: use the returned one).
          batches: the minibatches of one rollout batch, each packed like a `train_step` batch
            (e.g. ``pack_batch`` of each ``split_selection`` part; shapes may differ).

        Returns:
          ``(new_state, [metrics of each update])``: `train_step`'s metrics, plus
          ``ratio_mean`` (mean ``exp(pi - pi_old)``) and ``policy_shift`` (mean
          ``|pi - pi_old|``) over the loss tokens when there are several minibatches.

        Raises:
          TrainerError: no minibatch, or more than ``config.num_minibatches``.
          NonFiniteError: an update's loss or gradient norm is not finite; its ``state`` is
            the state after the previous updates.
        """
        n = len(batches)
        if not 1 <= n <= self.config.num_minibatches:
            raise TrainerError(
                f"Trainer.train_minibatches: {n} minibatches, expected 1 to "
                f"TrainerConfig.num_minibatches = {self.config.num_minibatches}"
            )
        if n == 1:
            state, metrics = self.train_step(state, batches[0])
            return state, [metrics]
        olds = [self.logprobs(state.params, b) for b in batches]
        out = []
        for i, (b, old) in enumerate(zip(batches, olds, strict=True)):
            state, metrics = self.train_step(state, b, old_logprobs=old, first_update=i == 0)
            out.append(metrics)
        return state, out

    @collective("train_step")  # multi-host: bounded, named (trainer.distributed)
    def train_step(
        self,
        state: TrainState,
        batch: Batch,
        old_logprobs: Any = None,
        *,
        first_update: bool = False,
    ) -> tuple[TrainState, dict[str, float]]:
        """One optimizer step over the whole ``batch`` (micro-batched as configured).

        ``state`` is donated: use only the returned state afterwards. Compiles once per padded
        batch shape (and once more for the ``old_logprobs`` form); owner and group counts are
        not part of it (`BatchBounds`). Runs under ``jax.transfer_guard("disallow")``; the only
        transfers are the explicit batch upload and the metrics download.

        Args:
          state: the current train state (laid out as ``state_shardings``).
          batch: the padded batch (numpy or device arrays); rows divide by
            ``num_micro_batches * data_parallel``; ids within ``bounds``.
          old_logprobs: f32[R, T] pi_old from `logprobs` when a rollout batch is used for more
            than one update; None: pi_old = the current policy (ratio 1).
          first_update: ``state.params`` are the parameters ``old_logprobs`` were computed
            with (the first update of a rollout batch): pi's value is ``old_logprobs`` itself,
            the gradient that of the step's own forward, so every ratio is exactly 1. Needs
            ``old_logprobs``; a traced flag (no extra compile).

        Returns:
          ``(new_state, metrics)``; metrics are host floats: loss, policy_loss, aux_loss,
          grad_norm, lr, gate_rejected_fraction, binary_kl_mean, is_weight_mean, clip_fraction,
          loss_tokens, logprob_abs_diff (mean |train - behaviour| logprob on loss tokens),
          entropy (mean on loss tokens), route_agreement (R3 on: the fraction of replayed
          (token, MoE layer) routes whose expert set equals the model's own top-k; NaN when
          none was replayed), step; with ``old_logprobs`` also ratio_mean and policy_shift
          (mean ``exp(pi - pi_old)`` and ``|pi - pi_old|`` on loss tokens).

        Raises:
          NonFiniteError: the loss or gradient norm is NaN/Inf (names the step; the update
            was skipped, the returned-by-exception state is unchanged).
          TrainerError: ``first_update`` without ``old_logprobs``, or a bad batch.
        """
        if first_update and old_logprobs is None:
            raise TrainerError("Trainer.train_step: first_update=True needs old_logprobs")
        batch, shardings = self._device_batch(batch)
        patches = 0 if batch.pixel_values is None else batch.pixel_values.shape[1]
        if (batch.tokens.shape, patches) not in self._checked_shapes:
            self.check_memory(*batch.tokens.shape, patches=patches)  # before compiling it
            self._checked_shapes.add((batch.tokens.shape, patches))
        first = None
        if old_logprobs is not None:
            old_logprobs = jax.device_put(old_logprobs, self._rows)
            first = jax.device_put(np.asarray(bool(first_update)), self._replicated)
        with jax.set_mesh(self.mesh), jax.transfer_guard("disallow"):
            state, metrics = self._functions(shardings)[0](state, batch, old_logprobs, first)
        host = {k: v.item() for k, v in jax.device_get(metrics).items()}
        finite = host.pop("finite")
        host["step"] = int(host["step"])
        if self.config.check_finite and not finite:
            raise NonFiniteError(host["step"], host, state=state)
        return state, host

    def check_memory(
        self, rows: int, seq: int, capacity: float | None = None, *, patches: int = 0
    ) -> Any:
        """Estimated per-device bytes of a step on ``rows x seq`` (`memory.check_step_fits`).

        ``patches``: image patches per row (the ViT's share of the estimate).

        Raises `TrainerError` naming what to change when the estimate exceeds the device's
        memory (``capacity``: default the device allocator's limit; unknown on CPU: no check).
        """
        # The parameters' actual split (experts over `expert`, embed dims over `fsdp`, ...).
        shapes = jax.tree.leaves(self._abstract_params)
        shardings = jax.tree.leaves(self.param_shardings)
        total = sum(math.prod(a.shape) for a in shapes)
        local = sum(
            math.prod(s.shard_shape(a.shape)) for a, s in zip(shapes, shardings, strict=True)
        )
        expert_parallel = self.mesh.shape.get("expert", 1) if self.runtime.expert_parallel else 1
        return check_step_fits(
            self.model,
            self.runtime,
            self.config,
            rows=rows,
            seq=seq,
            param_shards=total / local,
            batch_shards=self.data_parallel,
            expert_parallel=expert_parallel,
            patches=patches,
            capacity=capacity,
        )

    def _device_batch(self, batch: Batch) -> tuple[Any, Batch]:
        """Checks ``batch`` on the host and uploads it, rows split over the batch axes.

        Returns the device batch and its `batch_shardings`.
        """
        check_batch(batch)
        rows = batch.tokens.shape[0]
        need = self.config.num_micro_batches * self.data_parallel
        if rows % need:
            raise TrainerError(
                f"Batch.tokens: {rows} rows do not divide by num_micro_batches "
                f"({self.config.num_micro_batches}) x data-parallel size ({self.data_parallel})"
            )
        try:
            self.bounds.check(batch)
        except ValueError as e:
            raise TrainerError(str(e)) from None
        if not self.config.router_replay:
            # R3 off: the routes are not uploaded (the step never reads them).
            batch = batch._replace(routed_experts=None)  # type: ignore[arg-type]
        elif isinstance(batch.routed_experts, np.ndarray):
            validate_replay(batch.routed_experts, self.model)  # raises RouterReplayError
        if batch.has_images and not hasattr(self.model, "vision"):
            raise TrainerError(
                "Batch.pixel_values: the batch has images but the policy is a text model"
            )
        shardings = self.batch_shardings(batch)
        images = batch.images
        if images is None:
            return jax.device_put(batch, shardings), shardings
        device = jax.device_put(batch._replace(images=None), shardings._replace(pixel_values=None))
        return device._replace(pixel_values=device_pixel_values(images, self._rows)), shardings

    # ------------------------------------------------------------------ checkpoints, export

    @property
    def checkpointer(self) -> Checkpointer:
        """The checkpoint manager of ``config.checkpoint`` (created on first use)."""
        if self._checkpointer is None:
            self._checkpointer = Checkpointer(self.config.checkpoint)
        return self._checkpointer

    @collective("checkpoint_save")  # multi-host: bounded, named (trainer.distributed)
    def save(
        self, state: TrainState, step: int | None = None, data_state: Any = None, *, force=False
    ) -> bool:
        """Checkpoints ``state`` (and the data-iterator state) if ``step`` is on the cadence.

        ``step`` defaults to ``state.step``. Async saves are awaited by `close` / `restore`.
        """
        if step is None:
            step = int(jax.device_get(state.step))
        return self.checkpointer.save(state, step, data_state, force=force)

    @collective("checkpoint_restore")  # multi-host: bounded, named (trainer.distributed)
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
