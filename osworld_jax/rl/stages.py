"""The stages of one RL step, as small helpers the loop in `osworld_jax.rl.loop` calls in order.

Rollout (`osworld_jax.rl.rollouts`: all B x N owners concurrently under asyncio), segments and
the generation window, advantages, weight export + refit, and the step's records
(`osworld_jax.rl.metrics_step`); this module re-exports the other two's helpers. No math that
belongs in ``algorithms/`` lives here: the advantages are one call of the jitted, registered
estimator (``compute_advantages``) over the arrays `select_groups` built.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from osworld_jax.agent import (
    AgentConfig,
    GroupPolicyError,
    GroupSelection,
    OwnerRollout,
    VisionPacking,
    weight_version_number,
)
from osworld_jax.algorithms import compute_advantages
from osworld_jax.batch import BatchBounds
from osworld_jax.data import TaskRef
from osworld_jax.env import capabilities, load_task
from osworld_jax.errors import ConfigError, InfraError, OsworldJaxError
from osworld_jax.model import (
    ImageProcessor,
    Qwen3MoeConfig,
    Qwen3VLMoeConfig,
    make_tiny_checkpoint,
)
from osworld_jax.model.digest import params_digest
from osworld_jax.model.processor import PREPROCESSOR_FILE
from osworld_jax.rl.config import ModelSourceConfig, RLConfig
from osworld_jax.rl.metrics_step import (
    episode_files,
    mean_update_metrics,
    owner_records,
    start_compile_counts,
    step_metrics,
    timeline_metrics,
)
from osworld_jax.rl.rollouts import (
    RawRollouts,
    StepRollouts,
    TimedOwnerAgent,
    owner_seed,
    rollout_step,
)
from osworld_jax.rl.rundir import writing
from osworld_jax.rollout import SGLangClient
from osworld_jax.trainer.distributed import export_hf_all_processes, is_primary

__all__ = [  # the stage helpers, with those of rl/rollouts.py and rl/metrics_step.py
    "VERSION_ALIASES",
    "RawRollouts",
    "RolloutStepError",
    "RunnableFilter",
    "SkippedStepsError",
    "StepSkips",
    "StalenessError",
    "StepRollouts",
    "TimedOwnerAgent",
    "check_window",
    "collect_owners",
    "episode_files",
    "export_and_refit",
    "refit_in_memory",
    "refit_sglang",
    "mean_update_metrics",
    "model_dir",
    "owner_advantages",
    "owner_records",
    "owner_seed",
    "prepare_model",
    "rollout_step",
    "step_metrics",
    "timeline_metrics",
    "start_compile_counts",
    "vision_packing",
]


class RolloutStepError(OsworldJaxError):
    """Too many owners of a step failed (infrastructure is broken); the message lists errors."""


class StalenessError(OsworldJaxError):
    """An owner's tokens are from weights outside the step's window.

    Raised for tokens staler than ``max_staleness`` under ``stale_owners='refuse'``, and always
    for tokens of weights newer than the step trains (never possible in a sound run).
    """


log = logging.getLogger(__name__)


class SkippedStepsError(OsworldJaxError):
    """More bad steps in a row than ``RLConfig.max_consecutive_skipped_steps``; names causes."""


#: A bad step (too many failed owners, too few usable groups): skipped, not fatal (`StepSkips`).
BAD_STEP_ERRORS = (RolloutStepError, GroupPolicyError)


class StepSkips:
    """Skips bad steps and stops the run after too many in a row.

    A step whose rollout is unusable (`BAD_STEP_ERRORS`: more than ``max_failed_fraction`` of
    its owners failed, or too few groups survive the group policy) trains nothing: the loop
    still refits (the same weights under the step's version, so the next step's window is as
    always), checkpoints (the task stream's position after the step's draw: a resumed run goes
    on exactly where this one would) and logs ``steps/skipped = 1`` with the cause. Up to
    ``limit`` skipped steps in a row are allowed; one more raises `SkippedStepsError` naming
    every cause of the run of skips (``limit = 0``: the first bad step stops the run).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.causes: list[str] = []

    def skip(self, step: int, cause: str) -> dict[str, Any]:
        """Records a skipped step: its metrics, or `SkippedStepsError` past the limit."""
        self.causes.append(f"step {step}: {cause}")
        log.warning("step %d skipped (%d in a row): %s", step, len(self.causes), cause)
        if len(self.causes) > self.limit:
            raise SkippedStepsError(
                f"{len(self.causes)} bad steps in a row (RLConfig.max_consecutive_skipped_steps"
                f" = {self.limit}); causes: {'; '.join(self.causes)}"
            )
        return {
            "steps/skipped": 1.0,
            "steps/consecutive_skipped": float(len(self.causes)),
            "steps/skip_cause": cause,
        }

    def trained(self) -> dict[str, float]:
        """Records a trained step (the run of skips ends): its metrics."""
        self.causes.clear()
        return {"steps/skipped": 0.0, "steps/consecutive_skipped": 0.0}


# The version servers report before the first refit (SGLang's and the embedded server's
# default ``weight_version``): the base model, step 0.
VERSION_ALIASES = {"default": 0}


def model_dir(config: ModelSourceConfig, run_dir: Path) -> Path:
    """Where the run's starting HF checkpoint is (``<run_dir>/base_model`` for ``"tiny"``)."""
    return run_dir / "base_model" if config.path == "tiny" else Path(config.path).expanduser()


def prepare_model(config: ModelSourceConfig, run_dir: Path, *, weights: bool = True) -> Path:
    """The run's starting HF checkpoint: ``config.path``, or a tiny one built into the run dir
    (``weights=False``: its files but not its random weights, for ``--validate_only``)."""  # noqa: D205, D209
    if config.path != "tiny":
        return model_dir(config, run_dir)
    path = model_dir(config, run_dir)
    if not (path / "config.json").is_file():
        tmp = run_dir / "base_model.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        with writing(tmp):  # a full disk names the directory
            make_tiny_checkpoint(
                tmp,
                seed=config.tiny_seed,
                kind=config.tiny_kind,
                weights=weights,
                **config.tiny_overrides,
            )
        tmp.rename(path)
    return path


def vision_packing(
    model: Qwen3MoeConfig, model_path: Path, agent: AgentConfig
) -> VisionPacking | None:
    """How the run packs screenshots: None for a text model (or ``max_screenshots = 0``).

    The processor is the checkpoint's own (``preprocessor_config.json``). Patch buckets: one per
    possible image count of a row, ``k x`` the patches of one ``screen_width x screen_height``
    screenshot for ``k = 1 .. max_screenshots`` (a row is one segment, which shows at most that
    many), so the train step compiles at most once per count.
    """
    if not isinstance(model, Qwen3VLMoeConfig) or agent.max_screenshots == 0:
        return None
    if not (model_path / PREPROCESSOR_FILE).is_file():
        raise ConfigError(
            f"{model_path}: a qwen3_vl_moe checkpoint without {PREPROCESSOR_FILE} (the image "
            "processor decides how many tokens a screenshot takes)"
        )
    processor = ImageProcessor.from_pretrained(model_path)
    one = int(np.prod(processor.grid_thw(agent.screen_height, agent.screen_width)))
    k = agent.max_screenshots
    return VisionPacking(
        processor=processor,
        config=model,
        patch_buckets=tuple(one * i for i in range(1, k + 1)),
        image_slots=k,
    )


class RunnableFilter:
    """``keep(ref)`` for `make_task_stream`: the tasks ``backend`` can run here; records why not.

    ``config``: the backend's config (``ExperimentConfig.sandbox``; a backend name counts as
    none), which says where it looks (e.g. ``LocalBackendConfig.system_root``).

    Attributes:
      skipped: task id -> the reasons (``kind: detail``) it was dropped.
    """

    def __init__(
        self, backend: str, cache_dir: str | None = None, config: object | None = None
    ) -> None:
        self.backend, self.cache_dir = backend, cache_dir
        self.config = None if isinstance(config, str) else config
        self.skipped: dict[str, list[str]] = {}

    def __call__(self, ref: TaskRef) -> bool:
        """Whether the backend can run ``ref``'s task (records the reasons when not)."""
        verdict = capabilities(
            load_task(ref.path), self.backend, cache_dir=self.cache_dir, backend_config=self.config
        )
        if not verdict:
            reasons = getattr(verdict, "reasons", ())
            self.skipped[ref.task_id] = [f"{r.kind}: {r.detail}" for r in reasons]
        return bool(verdict)


def collect_owners(raw: RawRollouts, rl: RLConfig, step: int) -> StepRollouts:
    """Builds every owner's segments (`OwnerAgent.to_rollout`) in group-major order.

    A group whose run raised an ``InfraError`` fails all its owners; any other exception (a
    bug, a ``SegmentIntegrityError``) stops the run. More than ``max_failed_fraction`` failed
    owners raise `RolloutStepError` listing the errors.
    """
    n = rl.num_owners
    owners, turns, unparsed = [], [], []
    for g, res in enumerate(raw.results):
        if isinstance(res, BaseException):
            if not isinstance(res, InfraError):
                raise res
            for owner in range(g * n, (g + 1) * n):
                owners.append(_failed(owner, g, f"group {g} ({raw.tasks[g].task_id}): {res!r}"))
                turns.append(0)
                unparsed.append(0)
            continue
        by_owner = {r.owner_index: r for r in res}
        for owner in range(g * n, (g + 1) * n):
            r = by_owner.get(owner)
            if r is None or owner not in raw.agents:
                owners.append(_failed(owner, g, "no result from the environment"))
                turns.append(0)
                unparsed.append(0)
            else:
                owners.append(raw.agents[owner].to_rollout(r))
                turns.append(int(r.turns))
                unparsed.append(int(r.num_parse_errors))
    failed = [o for o in owners if o.failed]
    if len(failed) > rl.max_failed_fraction * len(owners):
        errors = sorted({str(o.error) for o in failed})
        raise RolloutStepError(
            f"step {step}: {len(failed)}/{len(owners)} owners failed (max_failed_fraction="
            f"{rl.max_failed_fraction}); errors: {errors[:3]}"
        )
    return StepRollouts(
        tasks=raw.tasks, owners=tuple(owners), turns=tuple(turns), parse_errors=tuple(unparsed)
    )


def check_window(
    rollouts: StepRollouts, rl: RLConfig, step: int
) -> tuple[StepRollouts, dict[str, float]]:
    """Validates the generation window of step ``step``: every trainable token's weight version.

    Step ``step`` trains the weights of version ``step - 1`` (the RL loop refits to
    ``str(step)`` after training step ``step``; ``"default"`` is the base model, 0). A token
    generated by version ``v`` is ``step - 1 - v`` steps stale; an owner whose oldest token is
    more than ``rl.max_staleness`` stale is masked (failed, its error naming the versions) or
    refused (`StalenessError`), as ``rl.stale_owners`` says. A version newer than ``step - 1``
    is always an integrity error.

    Returns:
      ``(rollouts with stale owners masked, metrics)``: ``staleness/max`` and
      ``staleness/mean`` (over the healthy owners' trainable tokens, before masking),
      ``staleness/tokens_<d>`` (the histogram: trainable tokens ``d`` steps stale, for ``d =
      0 .. max_staleness``, and ``staleness/tokens_beyond`` for older ones) and
      ``owners/stale``.

    Raises:
      StalenessError: a token from the future, or a stale owner under ``refuse``.
      WeightVersionError: a version that is neither a step number nor ``"default"``.
    """
    k, trained = rl.max_staleness, step - 1
    hist = np.zeros((k + 2,), np.int64)  # 0..k, then beyond
    owners, stale, max_age, age_sum = [], 0, 0, 0
    for o in rollouts.owners:
        if o.failed:
            owners.append(o)
            continue
        by_version = o.trainable_tokens_by_version()
        ages = {
            trained - weight_version_number(v, aliases=VERSION_ALIASES, owner_id=o.owner_id): n
            for v, n in by_version.items()
        }
        if any(age < 0 for age in ages):
            raise StalenessError(
                f"step {step}: owner {o.owner_id} has tokens of weight versions "
                f"{sorted(by_version)}, newer than the weights this step trains ({trained})"
            )
        for age, n in ages.items():
            hist[min(age, k + 1)] += n
            max_age, age_sum = max(max_age, age), age_sum + age * n
        oldest = max(ages, default=0)
        if oldest <= k:
            owners.append(o)
            continue
        stale += 1
        why = (
            f"step {step}: owner {o.owner_id} has tokens {oldest} steps stale (weight versions "
            f"{sorted(by_version)}, training version {trained}; RLConfig.max_staleness = {k})"
        )
        if rl.stale_owners == "refuse":
            raise StalenessError(why)
        owners.append(_failed(o.owner_id, o.group_id, f"stale: {why}"))
    total = int(hist.sum())
    m: dict[str, float] = {
        "staleness/max": float(max_age),
        "staleness/mean": age_sum / total if total else 0.0,
        "owners/stale": float(stale),
    }
    m.update({f"staleness/tokens_{d}": float(hist[d]) for d in range(k + 1)})
    m["staleness/tokens_beyond"] = float(hist[k + 1])
    return dataclasses.replace(rollouts, owners=tuple(owners)), m


def _failed(owner: int, group: int, error: str) -> OwnerRollout:
    return OwnerRollout(
        owner_id=owner, group_id=group, segments=(), reward=None, failed=True, error=error
    )


def owner_advantages(
    selection: GroupSelection, estimator: str, bounds: BatchBounds | None = None
) -> np.ndarray:
    """One advantage per selected owner: the registered estimator, jitted, in one call.

    With ``bounds`` the estimator's inputs are padded to ``bounds.num_owners`` owners (the
    padding is not ``valid``: it enters no statistic) over ``bounds.num_groups`` groups, so the
    estimator compiles once per run whatever the step dropped. Failed owners get 0: they are
    masked rows; whether they enter their group's statistics (as reward-0 placeholders,
    ``all_owners``) or not (``logical_owners``) is ``selection.valid``.

    Returns:
      f32[N] advantages of ``selection.owners``.
    """
    n = len(selection.owners)
    size, groups = n, selection.num_groups
    if bounds is not None:
        size, groups = bounds.num_owners, bounds.num_groups
    if n == 0:
        return np.zeros((0,), np.float32)
    if n > size:
        raise ValueError(f"{n} owners exceed BatchBounds.num_owners = {size}")

    def pad(x: np.ndarray, fill: Any) -> np.ndarray:
        return np.concatenate([x, np.full((size - n,), fill, x.dtype)])

    adv = compute_advantages(
        estimator,
        pad(selection.rewards, 0.0),
        pad(selection.group_index, 0),
        groups,
        valid=pad(selection.valid, False),
        token_counts=pad(selection.token_counts, 0.0),
    )
    return np.where(selection.failed, 0.0, np.asarray(adv)[:n]).astype(np.float32)


def refit_in_memory(
    trainer: Any, state: Any, client: SGLangClient | None, server: Any, step: int, runner: Any
) -> None:
    """Moves a colocated server to ``state``'s weights without a file.

    The trainer casts its parameters to the served dtype on the device (new buffers: the next
    step donates the state's own), digests them, stages them in the server's process
    (`osworld_jax.server.colocated.ColocatedServer.stage`) and refits: the server pauses only
    for the swap, and its reply's digest must equal the trainer's (bit-exact, or the refit
    fails). With ``max_staleness >= 1`` the cast runs while rollouts continue.
    """
    params = trainer.serving_params(state, server.dtype)
    weights = server.stage(params, expected_digest=params_digest(params))
    if client is not None and runner is not None:
        runner.run(client.refit(weights, str(step)))


def refit_sglang(
    trainer: Any,
    state: Any,
    client: SGLangClient | None,
    cfg: Any,
    step: int,
    runner: Any,
    *,
    tp_size: int = 1,
    sender: Any = None,
) -> None:
    """Moves real SGLang servers to ``state``'s weights in memory (``SGLangRefitConfig.path``
    ``tensor`` or ``distributed``: `osworld_jax.trainer.sglang_weights`), no file written."""  # noqa: D205, D209
    from osworld_jax.trainer.sglang_weights import sglang_weights

    weights = sglang_weights(trainer.policy(state.params), cfg, tp_size=tp_size, sender=sender)
    if client is not None and runner is not None:
        runner.run(client.refit(weights, str(step)))


def export_and_refit(
    trainer: Any,
    state: Any,
    client: SGLangClient | None,
    weights_dir: Path,
    step: int,
    keep: int,
    runner: Any,
    *,
    copy_files_from: Path,
) -> Path:
    """Exports ``state`` as HF weights (atomic) and moves every server to them.

    Every process calls it (multi-host: the sharded parameters are gathered and process 0
    writes); the processes that hold a rollout client refit their servers. Older exported
    directories beyond ``keep`` are deleted (never the one just served). The tokenizer files come
    from ``copy_files_from`` so that each exported directory is a complete checkpoint.
    """
    path = weights_dir / f"step_{step:08d}"
    # Every process joins (process 0 alone decides whether ``path`` still needs writing).
    with writing(path):  # a full disk names the export
        export_hf_all_processes(trainer, state, path, copy_files_from=copy_files_from)
    if client is not None and runner is not None:
        runner.run(client.refit(str(path.resolve()), str(step)))
    if is_primary():
        exports = [p for p in weights_dir.glob("step_*") if p.name[5:].isdigit()]  # not set aside
        for old in sorted(exports)[:-keep]:
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
    return path
