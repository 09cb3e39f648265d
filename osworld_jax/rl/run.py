"""Set-up and tear-down of a run: model, preflight, servers, client, sandboxes, trainer, data.

`RunResources` is a context manager: entering takes the run dir's lease (`rl/lease.py`: one
trainer at a time, nothing outlives it), builds everything the loop needs (resuming from the
run dir's latest checkpoint, or ``CheckpointConfig.restore_step``) and, once the run is starting,
writes its config files; leaving (normally, on an error or on Ctrl-C) closes the rollout client,
every sandbox and the backend, stops the embedded server, waits for an in-flight checkpoint save
so the last checkpoint stays intact, and releases the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import tempfile
from pathlib import Path
from typing import Any, Self

import jax.numpy as jnp

from osworld_jax.agent import AgentTokenizer
from osworld_jax.batch import BatchBounds
from osworld_jax.data import DataError, TaskRef, load_task_refs, make_task_stream, resolve_task_set
from osworld_jax.env import AgentEnv, Task, load_task, make_backend
from osworld_jax.env.local import LocalBackendConfig
from osworld_jax.env.local.limits import remove_tree
from osworld_jax.errors import ConfigError
from osworld_jax.model import Qwen3MoeConfig, load_hf_checkpoint, make_mesh
from osworld_jax.rl import stages
from osworld_jax.rl.analysis import EPISODES_DIR, ROLLOUTS_FILE
from osworld_jax.rl.config import ExperimentConfig, SandboxConfig
from osworld_jax.rl.lease import RunLease
from osworld_jax.rl.metrics import METRICS_FILE, MetricsLogger
from osworld_jax.rl.preflight import run_preflight
from osworld_jax.rl.producer import LoopThread
from osworld_jax.rl.rundir import (
    check_writable,
    trim_logs_to_checkpoint,
    write_run_config,
    writing,
)
from osworld_jax.rollout import SGLangClient
from osworld_jax.trainer import Trainer
from osworld_jax.trainer.checkpoint import CorruptCheckpointError, set_aside
from osworld_jax.trainer.distributed import barrier, initialize_distributed, is_primary
from osworld_jax.trainer.overlap import apply_overlap

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
#: The compiled memory plan's table, written at start on an accelerator.
MEMORY_PLAN_FILE = "memory_plan.txt"
WEIGHTS = "weights"


def _required_tasks(exp: ExperimentConfig) -> list[Task] | None:
    """The tasks that must all run here (``DataConfig.only_runnable`` off), else None."""
    if exp.data.only_runnable:
        return None
    try:
        return [load_task(r.path) for r in load_task_refs(resolve_task_set(exp.data.task_set))]
    except DataError:
        return None  # check_task_set reports it


class RolloutResources(contextlib.ExitStack):
    """What rolling out needs: model, preflight, servers, client, tokenizer, sandboxes.

    Attributes:
      experiment: the run's config.
      run_dir: the run directory.
      model_path: the starting HF checkpoint.
      model_config: its architecture (``config.json``).
      runner: the asyncio runner every async stage runs on (one event loop per run): an
        ``asyncio.Runner`` on the calling thread, or with ``RLConfig.max_staleness >= 1`` a
        `LoopThread` (the loop on its own thread, so rollouts run while the step trains).
      client: the rollout client.
      tokenizer: the agent's tokenizer + chat template (from the model dir).
      agent_env: the AgentEnv over the configured sandbox backend.
    """

    def __init__(self, experiment: ExperimentConfig, run_dir: Path) -> None:
        super().__init__()
        self.experiment = experiment
        self.run_dir = run_dir.resolve()

    def __enter__(self) -> Self:
        super().__enter__()
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def _open(self) -> None:
        exp = self.experiment
        apply_overlap(exp.rl.mesh.overlap)  # XLA_FLAGS, read when the backend starts
        from osworld_jax.rl.servers import share_devices, use_compilation_cache

        share_devices(exp)  # a GPU shared with the embedded server: this process's share
        use_compilation_cache(exp)
        initialize_distributed(exp.distributed)  # multi-host: join the job (no-op alone)
        self.rolls_out = is_primary()  # multi-host: process 0 drives servers and sandboxes
        check_writable(self.run_dir)  # read-only or full: one line before anything starts
        if self.rolls_out:
            # One trainer per run dir; what it starts dies with it (even by kill -9).
            self.lease = self.enter_context(RunLease(self.run_dir))
            stages.prepare_model(exp.model, self.run_dir)
        barrier("osworld_jax.rl:model")
        self.model_path = stages.model_dir(exp.model, self.run_dir)
        # k >= 1: the event loop runs on its own thread, so rollouts go on while the step trains
        runner: asyncio.Runner | LoopThread = (
            LoopThread() if exp.rl.max_staleness > 0 else asyncio.Runner()
        )
        self.runner = runner
        self.enter_context(runner)
        self.client: SGLangClient | None = None
        if self.rolls_out:
            backend = make_backend(self._sandbox())
            need = _required_tasks(exp)  # the backend checks what each task needs (e.g. apps)
            run_preflight(
                exp, model_path=self.model_path, backend_preflight=lambda: backend.preflight(need)
            )
            self.callback(self.runner.run, backend.aclose())  # after the client closes (LIFO)
        self.model_config = Qwen3MoeConfig.from_json(self.model_path / "config.json")
        if not self.rolls_out:
            return
        self._check_memory_plan()  # before the server starts and any weight is loaded
        urls = self._servers()
        self.tokenizer = AgentTokenizer.from_model_dir(self.model_path)
        # decodes the text when servers send none (SGLang with --skip-tokenizer-init)
        rollout = exp.rollout_for(self.model_config)  # R3 and the route shape, derived
        media = (self.tokenizer.token_id(t) for t in exp.agent.media_tokens)
        self.client = SGLangClient(
            urls,
            rollout,
            detokenize=self.tokenizer.decode,
            media_token_ids=[i for i in media if i is not None],
        )
        self.callback(self.runner.run, self.client.aclose())
        self.agent_env = AgentEnv(backend, exp.env)

    def _check_memory_plan(self) -> None:
        """On an accelerator: compiles the run's programs and refuses a plan that does not fit.

        Nothing is allocated yet, so the autotuner runs on a free device; with
        ``RLConfig.compilation_cache_dir`` the trainer's first steps and the server load these
        executables. On the CPU the train step checks its analytic estimate instead.
        """
        from osworld_jax.rl.memory_plan import compiled_plan, on_accelerator
        from osworld_jax.rl.servers import compilation_cache, device_total

        exp = self.experiment
        if not on_accelerator():
            return
        if compilation_cache(exp) is None:
            log.warning(
                "memory plan: no RLConfig.compilation_cache_dir, so the run compiles its "
                "programs again after the plan did (set it to compile each once)"
            )
        vision = stages.vision_packing(self.model_config, self.model_path, exp.agent)
        total = exp.rl.mesh.device_memory_gib
        plan = compiled_plan(
            exp,
            self.model_config,
            model_path=self.model_path,
            device_bytes=total * 2**30 if total is not None else device_total(),
            patch_buckets=vision.patch_buckets if vision is not None else (),
        )
        table = "\n".join(["memory plan (compiled programs, GiB per device):", *plan.table()])
        log.info("%s", table)
        with writing(self.run_dir / MEMORY_PLAN_FILE):  # beside the measured memory/peak_gib
            (self.run_dir / MEMORY_PLAN_FILE).write_text(table + "\n")
        plan.check()  # MemoryPlanError (a ConfigError): one line, nothing started yet

    def _sandbox(self) -> SandboxConfig:
        """The sandbox config; a local backend's sandboxes' root is recorded in the lease."""
        local = self.experiment.sandbox
        if not isinstance(local, LocalBackendConfig) or local.root is not None:
            return local
        root = Path(tempfile.mkdtemp(prefix="osworld_jax-local-"))
        self.lease.add_dir(root)  # removed by the reaper if the trainer dies
        self.callback(remove_tree, root)  # after the backend closed (LIFO)
        return dataclasses.replace(local, root=str(root))

    def _servers(self) -> tuple[str, ...]:
        exp = self.experiment
        self.colocated: Any = None  # the in-process server, refitted by hand-over
        if exp.server.launch == "none":
            return exp.rollout.urls
        from osworld_jax.rl.servers import server_group

        group = self.enter_context(server_group(exp, self.model_path, self.run_dir))
        if exp.server.refits_in_memory:
            self.colocated = group.servers[0]
        return group.urls


class RunResources(RolloutResources):
    """Everything one training run holds; see the module docstring.

    Attributes:
      metrics_dir: where metrics and per-owner records go.
      trainer: the trainer.
      state: the current train state.
      stream: the task stream.
      start_step: the last completed step (0 for a fresh run).
      pack_kwargs: the static arguments of ``pack_batch``.
    """

    def __init__(
        self, experiment: ExperimentConfig, run_dir: Path, operative_gin: str | None = None
    ) -> None:
        super().__init__(experiment, run_dir)
        self.operative_gin = operative_gin
        trainer_cfg = experiment.trainer
        if trainer_cfg.checkpoint.directory is None:
            ckpt = dataclasses.replace(
                trainer_cfg.checkpoint, directory=str(self.run_dir / CHECKPOINTS)
            )
            self.experiment = experiment.replace(
                trainer=dataclasses.replace(trainer_cfg, checkpoint=ckpt)
            )
        self.metrics_dir = (self.run_dir / experiment.rl.metrics_dir).resolve()

    def _open(self) -> None:
        super()._open()
        barrier("osworld_jax.rl:servers")  # the others wait here, bounded, while process 0 starts
        exp, rl = self.experiment, self.experiment.rl
        model_config = self.model_config
        m = rl.mesh
        mesh = make_mesh(data=m.data, fsdp=m.fsdp, expert=m.expert, tensor=m.tensor)
        policy = load_hf_checkpoint(
            self.model_path, dtype=jnp.dtype(exp.runtime.dtype), mesh=mesh, runtime=exp.runtime
        )
        norm = rl.norm_length or exp.rollout.sampling.max_new_tokens * exp.env.max_turns
        bounds = BatchBounds(
            num_owners=rl.num_logical_owners, num_groups=rl.num_prompts, norm_length=norm
        )
        self.trainer = Trainer(
            exp.trainer, policy, bounds=bounds, temperature=exp.logprob_temperature, mesh=mesh
        )
        self.callback(self.trainer.close)  # waits for an in-flight save: the checkpoint stays whole
        runnable = stages.RunnableFilter(exp.backend, exp.cache_dir, exp.sandbox)
        keep = runnable if exp.data.only_runnable else None
        # Every process draws the same stream (process 0 uses the tasks), so the checkpointed
        # stream position is the same on every process.
        self.stream = make_task_stream(
            exp.data, rl.rollout_groups, process_index=0, process_count=1, keep=keep
        )
        if runnable.skipped and self.rolls_out:
            skipped = self.run_dir / "skipped_tasks.json"
            with writing(skipped):
                skipped.write_text(json.dumps(runnable.skipped, indent=1, sort_keys=True))
            log.warning("%d not-runnable tasks skipped (see %s)", len(runnable.skipped), skipped)
        owners = rl.num_logical_owners
        self.pack_kwargs: dict[str, Any] = dict(
            num_layers=model_config.num_hidden_layers,
            top_k=model_config.num_experts_per_tok,
            num_experts=model_config.num_experts,
            dp_size=self.trainer.data_parallel * exp.trainer.num_micro_batches,
            length_buckets=rl.length_buckets or None,
            row_buckets=[owners * k for k in range(1, 9)],
            vision=stages.vision_packing(model_config, self.model_path, exp.agent),
        )
        self.weights_dir = self.run_dir / WEIGHTS
        self.weights_dir.mkdir(exist_ok=True, parents=True)
        resume = self._resume_step()
        if resume is None:
            self.state = self.trainer.init_state()
            self.start_step = 0
        else:
            self.state, data_state = self._restore(resume)
            if not isinstance(data_state, dict):
                raise ConfigError(f"{self.run_dir}: checkpoint {resume} has no task-stream state")
            self.stream.set_state(data_state)
            self.start_step = resume
            self.refit(resume)  # the servers start from the base model; serve the restored one
        if self.rolls_out:
            self.metrics_dir.mkdir(parents=True, exist_ok=True)
            # The steps after the checkpoint run again: drop what they logged (before their
            # checkpoint was durable, or whose save failed), and any line a full disk cut short.
            dropped = trim_logs_to_checkpoint(
                self.metrics_dir, self.start_step, (METRICS_FILE, ROLLOUTS_FILE), EPISODES_DIR
            )
            if dropped:
                log.warning("logs trimmed to checkpoint %d: dropped %s", self.start_step, dropped)
            records = open(self.metrics_dir / ROLLOUTS_FILE, "a", buffering=1)  # noqa: SIM115
            self._records = self.enter_context(records)
            # The run is starting: only now does it replace an existing run's config files.
            write_run_config(self.run_dir, self.experiment, self.operative_gin)

    def _resume_step(self) -> int | None:
        """The checkpoint to resume from: ``CheckpointConfig.restore_step``, else the newest.

        With ``restore_step``, the newer checkpoints are set aside (renamed, not deleted) so
        that this run's saves take their steps. On every resume, refit exports newer than the
        resumed step (written before a crash) are set aside too: they hold other weights than
        the ones this run will train, and an existing export is never rewritten.
        """
        ckpt = self.trainer.checkpointer
        wanted, steps = self.experiment.trainer.checkpoint.restore_step, ckpt.all_steps()
        if wanted is not None and wanted not in steps:
            raise ConfigError(
                f"CheckpointConfig.restore_step = {wanted}: {ckpt.directory} has no complete "
                f"checkpoint {wanted} (complete: {steps or 'none'})"
            )
        resume = wanted if wanted is not None else (steps[-1] if steps else None)
        if resume is not None and is_primary():
            aside = ckpt.set_aside_after(resume) if wanted is not None else []
            for export in sorted(self.weights_dir.glob("step_*")):
                if export.name[5:].isdigit() and int(export.name[5:]) > resume:
                    aside.append(set_aside(export))
            for path in aside:
                log.warning("resuming from checkpoint %d: set aside %s", resume, path)
        barrier("osworld_jax.rl:resume")
        ckpt.all_steps()  # every process sees what process 0 set aside
        return resume

    def _restore(self, step: int) -> tuple[Any, Any]:
        """`Trainer.restore` of ``step``; a damaged one names the previous complete step."""
        try:
            return self.trainer.restore(step)
        except CorruptCheckpointError as e:
            earlier = [s for s in self.trainer.checkpointer.all_steps() if s < step]
            hint = (
                f"resume from checkpoint {earlier[-1]}, the previous complete one, with "
                f"--gin_param='CheckpointConfig.restore_step = {earlier[-1]}' (the newer "
                "checkpoints are set aside, not deleted)"
                if earlier
                else "no earlier checkpoint to resume from: start a new run directory"
            )
            raise CorruptCheckpointError(e.step, e.path, f"{e.reason}; {hint}") from e

    def metrics_logger(self, last_step: int) -> contextlib.AbstractContextManager[Any]:
        """The run's `MetricsLogger` on the process that rolls out; elsewhere None."""
        if not self.rolls_out:
            return contextlib.nullcontext(None)
        return MetricsLogger(
            self.metrics_dir,
            total_steps=last_step,
            initial_step=self.start_step,
            progress_bar=self.experiment.rl.progress_bar,
        )

    async def rollout(self, tasks: list[TaskRef], step: int) -> stages.RawRollouts:
        """Rolls out the B x N owners of ``step`` (see `stages.rollout_step`)."""
        exp = self.experiment
        assert self.client is not None, "only the rolling-out process rolls out"
        return await stages.rollout_step(
            self.agent_env,
            self.client,
            self.tokenizer,
            exp.agent,
            exp.rollout.sampling,
            tasks,
            rl=exp.rl,
            step=step,
            load_task=load_task,
        )

    def refit(self, step: int) -> Path | None:
        """Moves every server to the current weights: handed over in memory to a colocated
        server (`stages.refit_in_memory`), else exported to disk (returns the export)."""  # noqa: D205, D209
        if getattr(self, "colocated", None) is not None:
            server, client = self.colocated, self.client
            stages.refit_in_memory(self.trainer, self.state, client, server, step, self.runner)
            return None
        sglang = self.experiment.server.sglang
        if self.experiment.server.launch in ("sglang", "none") and sglang.refit.path != "disk":
            if sglang.refit.path == "distributed" and getattr(self, "_sender", None) is None:
                from osworld_jax.trainer.sglang_weights import DistributedSender

                self._sender = DistributedSender(sglang.refit, tp_size=sglang.tp_size)
                self.callback(self._sender.close)
            stages.refit_sglang(
                self.trainer,
                self.state,
                self.client,
                sglang.refit,
                step,
                self.runner,
                tp_size=sglang.tp_size,
                sender=getattr(self, "_sender", None),
            )
            return None
        return stages.export_and_refit(
            self.trainer,
            self.state,
            self.client,
            self.weights_dir,
            step,
            self.experiment.rl.weights_keep,
            self.runner,
            copy_files_from=self.model_path,
        )

    def save(self, step: int, data_state: Any = None, *, force: bool = False) -> bool:
        """Checkpoints the train state with the task stream's position (on the cadence).

        ``data_state`` is the stream's position right after step ``step``'s tasks were drawn
        (`producer.Launched.data_state`); None takes the stream's current one.
        """
        if data_state is None:
            data_state = self.stream.get_state()
        return self.trainer.save(self.state, step, data_state, force=force)

    def write_episodes(
        self, step: int, raw: stages.RawRollouts, rollouts: stages.StepRollouts
    ) -> None:
        """Writes the first ``episode_owners`` episodes (see `stages.episode_files`)."""
        files = stages.episode_files(step, raw, rollouts, self.experiment.rl.episode_owners)
        root = self.metrics_dir / EPISODES_DIR
        for name, data in files.items():
            path = root / name
            if path.exists():  # an image already written by an earlier step
                continue
            with writing(path):
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)

    def write_owner_records(self, records: list[dict[str, Any]]) -> None:
        """Appends per-owner records to ``rollouts.jsonl``."""
        with writing(self._records.name):
            for r in records:
                self._records.write(json.dumps(r) + "\n")
