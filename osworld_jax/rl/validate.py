"""``--validate_only``: a run checked without running it (preflight and the memory plan).

Nothing is written to a run directory. The analytic estimate needs only the model's shapes
(``config.json``); on the run's accelerator the compiled programs' plan decides
(`osworld_jax.rl.memory_plan`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

import jax

from osworld_jax.env import make_backend
from osworld_jax.env.local import LocalBackendConfig
from osworld_jax.errors import ConfigError, PreflightError
from osworld_jax.model import Qwen3MoeConfig
from osworld_jax.model.processor import PREPROCESSOR_FILE, QWEN3_VL_PREPROCESSOR
from osworld_jax.rl import stages
from osworld_jax.rl.config import ExperimentConfig
from osworld_jax.rl.preflight import run_preflight
from osworld_jax.rl.run import _required_tasks
from osworld_jax.trainer import TrainerError


class ValidationError(PreflightError):
    """``--validate_only`` found problems; ``lines`` holds what it could check all the same.

    Attributes:
      lines: the model and the memory estimate (from ``config.json`` alone), as `validate`
        returns them for a valid run.
    """

    def __init__(self, message: str, lines: list[str]) -> None:
        super().__init__(message)
        self.lines = lines


def _shapes_dir(model_path: Path, tmp: Path) -> Path | None:
    """A directory with the model's ``config.json`` (and an image processor) for the estimate.

    ``model_path``: an HF checkpoint directory (weights or not), or its ``config.json`` itself.
    A Qwen3-VL checkpoint without ``preprocessor_config.json`` gets Qwen3-VL's published one.
    None when there is no ``config.json`` to read.
    """
    config = model_path if model_path.is_file() else model_path / "config.json"
    if not config.is_file():
        return None
    if config.parent == model_path and (model_path / PREPROCESSOR_FILE).is_file():
        return model_path
    shapes = tmp / "shapes"
    shapes.mkdir(exist_ok=True)
    shutil.copyfile(config, shapes / "config.json")
    processor = config.parent / PREPROCESSOR_FILE
    text = processor.read_text() if processor.is_file() else json.dumps(QWEN3_VL_PREPROCESSOR)
    (shapes / PREPROCESSOR_FILE).write_text(text)
    return shapes


def validate(experiment: ExperimentConfig) -> list[str]:
    """Checks a run without running it: preflight and the step's memory estimate.

    Nothing is written to a run directory: a tiny model's files (not its random weights) are
    made in a temporary directory, a local backend's sandboxes live in another. Nothing is
    compiled. The estimate needs only the model's shapes: ``ModelSourceConfig.path`` may be a
    directory holding only ``config.json`` (the weights not downloaded yet) or the
    ``config.json`` itself. The memory checks use ``MeshConfig.device_memory_gib`` where set
    (a GPU recipe checked on a machine without that GPU), else what the devices report: the
    train step against the trainer's share, an embedded server's weights and KV cache against
    its share (``ServerConfig.device_memory_fraction``).

    Returns:
      lines for the user: the model, the preflight, the estimate of one train step (and of the
      embedded server on a shared device).

    Raises:
      ValidationError: a part of the run is missing (one line each, as a run's start); its
        ``lines`` hold the model and the memory estimate wherever ``config.json`` was found.
      TrainerError: the step does not fit the device (with what would).
      ConfigError: the embedded server does not fit its share (with what would).
    """
    from osworld_jax.rl.memory_plan import compiled_plan, on_accelerator
    from osworld_jax.rl.servers import device_total

    exp = experiment
    problem: PreflightError | None = None
    with tempfile.TemporaryDirectory(prefix="osworld_jax-validate-") as tmp:
        tiny = exp.model.path == "tiny"
        model_path = stages.prepare_model(exp.model, Path(tmp), weights=not tiny)
        sandbox = exp.sandbox
        if isinstance(sandbox, LocalBackendConfig) and sandbox.root is None:
            sandbox = dataclasses.replace(sandbox, root=str(Path(tmp) / "sandboxes"))
        backend = make_backend(sandbox)
        try:
            need = _required_tasks(exp)
            run_preflight(
                exp,
                model_path=model_path,
                backend_preflight=lambda: backend.preflight(need),
                weights_made_by_run=tiny,
            )
        except PreflightError as e:
            problem = e
        finally:
            asyncio.run(backend.aclose())
        shapes = _shapes_dir(model_path, Path(tmp))
        if shapes is None:  # nothing to estimate from
            if problem is not None:
                raise ValidationError(str(problem), []) from None
            raise ConfigError(f"{model_path}: no config.json (ModelSourceConfig.path)")
        model = Qwen3MoeConfig.from_json(shapes / "config.json")
        vision = stages.vision_packing(model, shapes, exp.agent)
        patches = max(vision.patch_buckets, default=0) if vision is not None else 0
        plan = None
        if on_accelerator() and problem is None:  # compiled while config.json exists
            gib = exp.rl.mesh.device_memory_gib
            plan = compiled_plan(
                exp,
                model,
                model_path=shapes,
                device_bytes=gib * 2**30 if gib is not None else device_total(),
                patch_buckets=vision.patch_buckets if vision else (),
            )
    where = str(model_path)
    if tiny:  # built by the run: the tiny model, or the random one of tiny_overrides' shapes
        where = "a random model the run builds" if exp.model.tiny_overrides else "the tiny model"
    size = f"{model.num_hidden_layers} layers, {model.num_experts} experts"
    if not tiny and not any(model_path.glob("*.safetensors")):
        size += "; shapes from config.json, no weights"
    head = f"model: {where} ({size})"
    checked = f"preflight: ok (sandbox backend {exp.backend!r}, task set {exp.data.task_set!r})"
    memory = _memory_lines(exp, model, patches, compiled=plan is not None)
    if problem is not None:
        raise ValidationError(str(problem), [head, *memory]) from None
    if plan is not None:
        plan_lines = ["memory plan (compiled programs, GiB per device):", *plan.table()]
        plan.check()  # MemoryPlanError: one line naming the program, its peak and the knob
    else:
        plan_lines = [
            "memory plan: the compiled programs' plan needs the run's accelerator (this "
            f"machine runs jax on {jax.default_backend()}): the figures above are the analytic "
            "estimate"
        ]
    return [head, checked, *memory, *plan_lines]


def _memory_lines(
    exp: ExperimentConfig, model: Qwen3MoeConfig, patches: int, *, compiled: bool = False
) -> list[str]:
    """The memory estimate of one train step (and of an embedded server sharing the device);
    with ``compiled`` (the compiled plan decides) it is shown but refuses nothing."""  # noqa: D205, D209
    from osworld_jax.rl.servers import check_server_fits, memory_shares
    from osworld_jax.trainer.memory import GiB, check_step_fits

    rl, m = exp.rl, exp.rl.mesh
    rows = rl.num_logical_owners
    seq = max(rl.length_buckets, default=exp.agent.compaction.max_context_tokens)
    device = m.device_memory_gib * GiB if m.device_memory_gib is not None else None
    if compiled:  # on the accelerator the compiled plan refuses; the analytic one is shown
        device = None
    shares = memory_shares(exp.server)
    trainer_bytes = None if device is None else device * (shares[1] if shares else 1.0)
    lines = []
    if device is not None and shares is not None:  # the server shares the trainer's device
        lines.append(f"memory: the embedded server needs {check_server_fits(exp, model, device)}")
    try:
        est = check_step_fits(
            model,
            exp.runtime,
            exp.trainer,
            rows=rows,
            seq=seq,
            param_shards=m.fsdp * m.expert * m.tensor,
            batch_shards=m.data,
            expert_parallel=m.expert if exp.runtime.expert_parallel else 1,
            patches=patches,
            capacity=trainer_bytes,
        )
    except TrainerError as e:
        if shares is None:
            raise
        raise TrainerError(
            f"{e}; or a smaller server share (ServerConfig.device_memory_fraction = {shares[0]} "
            f"leaves the trainer {shares[1]} of each device)"
        ) from None
    size = f"{est.total / GiB:.1f} GiB" if est.total >= GiB else f"{est.total / 2**20:.0f} MiB"
    of = "" if trainer_bytes is None else f" of {trainer_bytes / GiB:.1f} GiB"
    return [
        *lines,
        f"memory: one train step of {rows} rows x {seq} tokens"
        + (f" ({patches} image patches per row)" if patches else "")
        + f" needs ~{size}{of} per device (of {m.data * m.fsdp * m.expert * m.tensor})",
    ]
