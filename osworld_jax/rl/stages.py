"""The stages of one RL step, as small helpers the loop in `osworld_jax.rl.loop` calls in order.

Rollout (all B x N owners concurrently under asyncio), segments, advantages, weight export +
refit, and the step's metrics. No math that belongs in ``algorithms/`` lives here: the
advantages are one call of the jitted, registered estimator (``compute_advantages``) over the
arrays `select_groups` built.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from osworld_jax.agent import (
    AgentConfig,
    AgentTokenizer,
    GroupSelection,
    OwnerAgent,
    OwnerRollout,
    VisionPacking,
    weight_version_number,
)
from osworld_jax.algorithms import compute_advantages
from osworld_jax.batch import Batch, BatchBounds
from osworld_jax.data import TaskRef
from osworld_jax.env import capabilities, load_task
from osworld_jax.errors import ConfigError, InfraError, OsworldJaxError
from osworld_jax.model import (
    ImageProcessor,
    Qwen3MoeConfig,
    Qwen3VLMoeConfig,
    make_tiny_checkpoint,
)
from osworld_jax.model.processor import PREPROCESSOR_FILE
from osworld_jax.rl.config import ModelSourceConfig, RLConfig
from osworld_jax.rl.rundir import writing
from osworld_jax.rollout import SamplingParams, SGLangClient
from osworld_jax.trainer.distributed import export_hf_all_processes, is_primary


class RolloutStepError(OsworldJaxError):
    """Too many owners of a step failed (infrastructure is broken); the message lists errors."""


class StalenessError(OsworldJaxError):
    """An owner's tokens are from weights outside the step's window.

    Raised for tokens staler than ``max_staleness`` under ``stale_owners='refuse'``, and always
    for tokens of weights newer than the step trains (never possible in a sound run).
    """


# The version servers report before the first refit (SGLang's and the embedded server's
# default ``weight_version``): the base model, step 0.
VERSION_ALIASES = {"default": 0}


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepRollouts:
    """The B x N owners of one step, in group-major order (owner ``g * N + j``).

    With streaming train B' <= B groups (`RawRollouts.tasks`) take B's place.

    Attributes:
      tasks: the B task references (group ``g`` is ``tasks[g]``).
      owners: B x N owner rollouts (``group_id`` = g).
      turns: B x N episode lengths (actions taken).
    """

    tasks: tuple[TaskRef, ...]
    owners: tuple[OwnerRollout, ...]
    turns: tuple[int, ...]


def model_dir(config: ModelSourceConfig, run_dir: Path) -> Path:
    """Where the run's starting HF checkpoint is (``<run_dir>/base_model`` for ``"tiny"``)."""
    return run_dir / "base_model" if config.path == "tiny" else Path(config.path).expanduser()


def prepare_model(config: ModelSourceConfig, run_dir: Path) -> Path:
    """The run's starting HF checkpoint: ``config.path``, or a tiny one built into the run dir."""
    if config.path != "tiny":
        return model_dir(config, run_dir)
    path = model_dir(config, run_dir)
    if not (path / "config.json").is_file():
        tmp = run_dir / "base_model.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        with writing(tmp):  # a full disk names the directory
            make_tiny_checkpoint(
                tmp, seed=config.tiny_seed, kind=config.tiny_kind, **config.tiny_overrides
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

    Attributes:
      skipped: task id -> the reasons (``kind: detail``) it was dropped.
    """

    def __init__(self, backend: str, cache_dir: str | None = None) -> None:
        self.backend, self.cache_dir = backend, cache_dir
        self.skipped: dict[str, list[str]] = {}

    def __call__(self, ref: TaskRef) -> bool:
        """Whether the backend can run ``ref``'s task (records the reasons when not)."""
        verdict = capabilities(load_task(ref.path), self.backend, cache_dir=self.cache_dir)
        if not verdict:
            reasons = getattr(verdict, "reasons", ())
            self.skipped[ref.task_id] = [f"{r.kind}: {r.detail}" for r in reasons]
        return bool(verdict)


def owner_seed(seed: int | None, step: int, owner: int) -> int | None:
    """A per-(step, owner) sampling seed derived from the run seed (stable across resumes)."""
    if seed is None:
        return None
    digest = hashlib.sha256(f"{seed}:{step}:{owner}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


class TimedOwnerAgent(OwnerAgent):
    """An `OwnerAgent` that also measures its episode: wall time and time inside ``act``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.started = time.perf_counter()
        self.act_seconds = 0.0
        self.episode_seconds = 0.0

    async def act(self, observation: Any) -> str:
        """Times `OwnerAgent.act` (prompting + generation)."""
        t0 = time.perf_counter()
        try:
            return await super().act(observation)
        finally:
            self.act_seconds += time.perf_counter() - t0

    async def on_episode_end(self, result: Any) -> None:
        """Records the episode's wall time."""
        self.episode_seconds = time.perf_counter() - self.started
        await super().on_episode_end(result)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RawRollouts:
    """What the env returned for one step, before segments are built.

    Attributes:
      tasks: the B' trained task references (group ``g`` is ``tasks[g]``; B' = B without
        streaming train, at most B with it).
      agents: owner index -> its agent (history, timing).
      results: per group, the env's ``OwnerResult`` list, or the group's exception.
      launched: groups the step rolled out (B + e; None: ``len(tasks)``).
      stragglers: groups still running when the step's rollout returned (cancelled).
      unused: groups that finished but were not trained (beyond B).
    """

    tasks: tuple[TaskRef, ...]
    agents: dict[int, TimedOwnerAgent]
    results: tuple[list[Any] | BaseException, ...]
    launched: int | None = None
    stragglers: int = 0
    unused: int = 0

    def group_metrics(self) -> dict[str, float]:
        """``groups/launched``, ``groups/stragglers`` (cancelled) and ``groups/unused``."""
        launched = len(self.tasks) if self.launched is None else self.launched
        return {
            "groups/launched": float(launched),
            "groups/stragglers": float(self.stragglers),
            "groups/unused": float(self.unused),
        }

    def timing(self) -> dict[str, float]:
        """Mean per-owner seconds spent generating (``act``) and in the sandbox (the rest)."""
        eps = [a for a in self.agents.values() if a.episode_seconds > 0]
        if not eps:
            return {}
        gen = float(np.mean([a.act_seconds for a in eps]))
        wall = float(np.mean([a.episode_seconds for a in eps]))
        return {"time/owner_generate": gen, "time/owner_env": max(wall - gen, 0.0)}


async def rollout_step(
    agent_env: Any,
    client: SGLangClient,
    tokenizer: AgentTokenizer,
    agent_config: AgentConfig,
    sampling: SamplingParams,
    tasks: Sequence[TaskRef],
    *,
    rl: RLConfig,
    step: int,
    load_task: Any,
) -> RawRollouts:
    """Runs N owners on each of the tasks (B + e of them), all owners at once (asyncio).

    Owner ``g * N + j`` is owner j of group g. A group whose run raised is recorded with its
    exception (`collect_owners` decides what it means). Without streaming train (``rl.streaming``
    False) every group is awaited. With it, the rollout returns once ``rl.min_groups`` groups
    have finished (a group that raised counts): the finished groups are taken in launch order
    (at most B) and renumbered ``0 .. B' - 1`` (owner ids, group ids, result owner indices;
    request ids already sent keep their names, sampling seeds are the launch index's), the
    groups still running are cancelled (``AgentEnv.run_group`` closes their sandboxes) and
    awaited.
    """
    n = rl.num_owners
    agents: dict[int, TimedOwnerAgent] = {}
    attempts: dict[int, int] = {}

    def make_agent(owner: int) -> TimedOwnerAgent:
        # A retried owner (AgentEnvConfig.max_owner_retries) gets a new agent per attempt, with
        # its own request ids; agents[owner] is the latest, whose history the rollout uses.
        k = attempts[owner] = attempts.get(owner, -1) + 1
        agents[owner] = TimedOwnerAgent(
            client,
            tokenizer,
            agent_config,
            owner_id=owner,
            group_id=owner // n,
            sampling=sampling.replace(sampling_seed=owner_seed(rl.seed, step, owner)),
            rid_prefix=f"s{step}" if k == 0 else f"s{step}a{k}",
            action_space=agent_env.config.action_space,
        )
        return agents[owner]

    async def group(g: int, ref: TaskRef) -> list[Any]:
        task = load_task(ref.path)
        return await agent_env.run_group(task, list(range(g * n, (g + 1) * n)), make_agent)

    if not rl.streaming:
        results = await asyncio.gather(
            *(group(g, ref) for g, ref in enumerate(tasks)), return_exceptions=True
        )
        for res in results:
            if isinstance(res, BaseException) and not isinstance(res, Exception):
                raise res  # cancellation / KeyboardInterrupt
        return RawRollouts(tasks=tuple(tasks), agents=agents, results=tuple(results))
    jobs = [asyncio.create_task(group(g, ref)) for g, ref in enumerate(tasks)]
    try:
        pending = set(jobs)
        while pending and len(jobs) - len(pending) < rl.min_groups:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    finally:  # the stragglers (every group, when this wait was itself cancelled)
        for job in jobs:
            job.cancel()  # a no-op for the finished ones
        stragglers = {job for job in jobs if not job.done()}
        await asyncio.gather(*jobs, return_exceptions=True)
    finished = [g for g, job in enumerate(jobs) if job not in stragglers]
    outcomes = {g: _outcome(jobs[g]) for g in finished}  # every exception retrieved
    trained = finished[: rl.num_prompts]
    for g in finished[rl.num_prompts :]:
        out = outcomes[g]
        if isinstance(out, Exception) and not isinstance(out, InfraError):
            raise out  # a bug, even in a group not trained
    return RawRollouts(
        tasks=tuple(tasks[g] for g in trained),
        agents=_renumber(agents, trained, n),
        results=tuple(_renumber_results(outcomes[g], g, new, n) for new, g in enumerate(trained)),
        launched=len(jobs),
        stragglers=len(stragglers),
        unused=len(finished) - len(trained),
    )


def _outcome(job: asyncio.Task[list[Any]]) -> list[Any] | BaseException:
    """A finished group's result or exception (cancellation / KeyboardInterrupt re-raised)."""
    if job.cancelled():
        raise asyncio.CancelledError(f"group task {job.get_name()} was cancelled")
    exc = job.exception()
    if exc is not None and not isinstance(exc, Exception):
        raise exc
    return exc if exc is not None else job.result()


def _renumber(
    agents: dict[int, TimedOwnerAgent], groups: Sequence[int], n: int
) -> dict[int, TimedOwnerAgent]:
    """The agents of launch groups ``groups``, renumbered: group ``groups[i]`` becomes group i."""
    out: dict[int, TimedOwnerAgent] = {}
    for new, g in enumerate(groups):
        for j in range(n):
            agent = agents.get(g * n + j)
            if agent is not None:
                agent.history.owner_id, agent.history.group_id = new * n + j, new
                if agent.result is not None:
                    agent.result = dataclasses.replace(agent.result, owner_index=new * n + j)
                out[new * n + j] = agent
    return out


def _renumber_results(
    res: list[Any] | BaseException, old: int, new: int, n: int
) -> list[Any] | BaseException:
    """Group ``old``'s ``OwnerResult`` list with owner indices moved to group ``new``."""
    if isinstance(res, BaseException) or old == new:
        return res
    shift = (new - old) * n
    return [dataclasses.replace(r, owner_index=r.owner_index + shift) for r in res]


def collect_owners(raw: RawRollouts, rl: RLConfig, step: int) -> StepRollouts:
    """Builds every owner's segments (`OwnerAgent.to_rollout`) in group-major order.

    A group whose run raised an ``InfraError`` fails all its owners; any other exception (a
    bug, a ``SegmentIntegrityError``) stops the run. More than ``max_failed_fraction`` failed
    owners raise `RolloutStepError` listing the errors.
    """
    n = rl.num_owners
    owners, turns = [], []
    for g, res in enumerate(raw.results):
        if isinstance(res, BaseException):
            if not isinstance(res, InfraError):
                raise res
            for owner in range(g * n, (g + 1) * n):
                owners.append(_failed(owner, g, f"group {g} ({raw.tasks[g].task_id}): {res!r}"))
                turns.append(0)
            continue
        by_owner = {r.owner_index: r for r in res}
        for owner in range(g * n, (g + 1) * n):
            r = by_owner.get(owner)
            if r is None or owner not in raw.agents:
                owners.append(_failed(owner, g, "no result from the environment"))
                turns.append(0)
            else:
                owners.append(raw.agents[owner].to_rollout(r))
                turns.append(int(r.turns))
    failed = [o for o in owners if o.failed]
    if len(failed) > rl.max_failed_fraction * len(owners):
        errors = sorted({str(o.error) for o in failed})
        raise RolloutStepError(
            f"step {step}: {len(failed)}/{len(owners)} owners failed (max_failed_fraction="
            f"{rl.max_failed_fraction}); errors: {errors[:3]}"
        )
    return StepRollouts(tasks=raw.tasks, owners=tuple(owners), turns=tuple(turns))


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
    estimator compiles once per run whatever the step dropped. Failed owners get 0 (they are
    masked rows; under ``baseline_population='all_owners'`` they still shaped the baseline).

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


def mean_update_metrics(updates: Sequence[dict[str, float]]) -> dict[str, float]:
    """One step's train metrics: the mean over its optimizer updates (the update's own for one)."""
    if len(updates) == 1:
        return dict(updates[0])
    keys = [k for k in updates[0] if all(k in u for u in updates)]
    out = {k: float(np.mean([float(u[k]) for u in updates])) for k in keys}
    out["updates"] = float(len(updates))
    return out


def timeline_metrics(launched: Any, timer: Any, producer: Any) -> dict[str, float]:
    """When the step's rollout and train ran (seconds since the loop started) and how far ahead.

    ``timeline/rollout_start`` / ``_end`` (from the rollout's launch to its result),
    ``timeline/train_start`` / ``_end``; ``rollout/wall`` (the rollout's own duration, which
    may overlap earlier steps' training: ``time/rollout`` is only the wait for it) and
    ``rollout/in_flight`` (later steps' rollouts running when this one trained).
    """
    t0, out = producer.started_at, {}
    if launched.launched_at is not None and launched.finished_at is not None:
        out["timeline/rollout_start"] = launched.launched_at - t0
        out["timeline/rollout_end"] = launched.finished_at - t0
        out["rollout/wall"] = launched.finished_at - launched.launched_at
    if "train" in timer.spans:
        start, end = timer.spans["train"]
        out["timeline/train_start"], out["timeline/train_end"] = start - t0, end - t0
    out["rollout/in_flight"] = float(producer.in_flight)
    return out


def step_metrics(
    rollouts: StepRollouts,
    selection: GroupSelection,
    adv: np.ndarray,
    batches: Batch | Sequence[Batch],
    train_metrics: dict[str, float],
    success_reward: float,
) -> dict[str, float]:
    """The scalars logged for one step (rewards, gate, KL, R3 agreement, tokens, failures).

    ``batches``: the step's device batch, or its minibatches (token and row counts are summed,
    ``batch/length`` is the longest).
    """
    parts = [batches] if isinstance(batches, Batch) else list(batches)
    healthy = [o for o in rollouts.owners if not o.failed]
    rewards = np.array([o.reward for o in healthy], np.float64)
    seg_counts = [len(o.segments) for o in healthy]
    real_tokens = sum(float((np.asarray(b.segment_ids) > 0).sum()) for b in parts)
    grids = [np.asarray(b.image_grid_thw) for b in parts if b.image_grid_thw is not None]
    m: dict[str, float] = {
        "reward/mean": float(rewards.mean()) if rewards.size else float("nan"),
        "reward/std": float(rewards.std()) if rewards.size else float("nan"),
        "reward/pass_rate": float((rewards >= success_reward).mean())
        if rewards.size
        else float("nan"),
        "owners/total": len(rollouts.owners),
        "owners/failed": len(rollouts.owners) - len(healthy),
        "owners/trained": len(selection.owners),
        "groups/dropped": len(selection.dropped_group_ids),
        "segments/per_owner": float(np.mean(seg_counts)) if seg_counts else 0.0,
        "turns/mean": float(np.mean(rollouts.turns)),
        "tokens/trainable": float(sum(np.asarray(b.loss_mask).sum() for b in parts)),
        "tokens/total": real_tokens,
        "batch/rows": float(sum(b.tokens.shape[0] for b in parts)),
        "batch/length": float(max(b.tokens.shape[1] for b in parts)),
        "advantage/mean": float(adv.mean()) if adv.size else 0.0,
        "advantage/abs_mean": float(np.abs(adv).mean()) if adv.size else 0.0,
    }
    m["batch/images"] = float(sum((g[..., 0] > 0).sum() for g in grids))
    if grids:
        m["batch/image_patches"] = float(
            sum(np.prod(g.astype(np.int64), axis=-1).sum() for g in grids)
        )
    renames = {
        "gate_rejected_fraction": "gate/rejected_fraction",
        "binary_kl_mean": "gate/binary_kl_mean",
        "logprob_abs_diff": "logprob/train_rollout_abs_diff",
        "route_agreement": "r3/route_agreement",
    }
    for k, v in train_metrics.items():
        if k != "step":
            m[renames.get(k, f"train/{k}")] = float(v)
    return m


def episode_files(
    step: int, raw: RawRollouts, rollouts: StepRollouts, owners: int
) -> dict[str, bytes]:
    """The episodes of the step's first ``owners`` owners, as files relative to ``episodes/``.

    ``step_{step:08d}_owner_{o}.json`` holds the task, reward and, per model call, the
    screenshots its prompt showed (``images/<sha256>.png``, each PNG written once), the reply
    text and the finish reason; declared compactions are listed with the call they precede.
    """
    files: dict[str, bytes] = {}
    for o in rollouts.owners[:owners]:
        agent = raw.agents.get(o.owner_id)
        if agent is None:
            continue
        calls = []
        for i, call in enumerate(agent.history.calls):
            names = []
            for png in call.images:
                name = f"images/{hashlib.sha256(png).hexdigest()[:20]}.png"
                files.setdefault(name, png)
                names.append(name)
            calls.append(
                {
                    "call": i,
                    "images": names,
                    "reply": call.text,
                    "finish_reason": call.finish_reason.get("type"),
                    "prompt_tokens": int(call.prompt_ids.size),
                    "output_tokens": int(call.output_ids.size),
                }
            )
        record = {
            "step": step,
            "owner": o.owner_id,
            "task_id": rollouts.tasks[o.group_id].task_id,
            "reward": o.reward,
            "failed": o.failed,
            "error": o.error,
            "calls": calls,
            "compactions": [dataclasses.asdict(c) for c in agent.history.compactions],
        }
        name = f"step_{step:08d}_owner_{o.owner_id}.json"
        files[name] = json.dumps(record, indent=1).encode()
    return files


def owner_records(
    step: int, rollouts: StepRollouts, selection: GroupSelection, adv: np.ndarray
) -> list[dict[str, Any]]:
    """One ``rollouts.jsonl`` record per owner of the step (reward, advantage, failure, ...)."""
    adv_of = {o.owner_id: float(a) for o, a in zip(selection.owners, adv, strict=True)}
    n = len(rollouts.owners) // max(len(rollouts.tasks), 1)
    out = []
    for o, turns in zip(rollouts.owners, rollouts.turns, strict=True):
        ref = rollouts.tasks[o.owner_id // n]
        out.append(
            {
                "step": step,
                "task_id": ref.task_id,
                "group_id": ref.group_id,
                "owner": o.owner_id,
                "reward": o.reward,
                "failed": o.failed,
                "error": o.error,
                "advantage": adv_of.get(o.owner_id),
                "turns": turns,
                "segments": len(o.segments),
                "trainable_tokens": o.num_trainable,
            }
        )
    return out
