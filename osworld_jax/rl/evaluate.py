"""pass@N evaluation of a checkpoint or a server on a task set -> a calibration JSONL.

Each task of the task set (one pass, task-set order; tasks the backend cannot run here are left
out when ``DataConfig.only_runnable``) is attempted ``reps`` times by ``reps``
owners on forks of one initialised sandbox (the same AgentEnv path as training, without
training); ``num_prompts`` tasks run concurrently. One line per task::

    {"task_id": ..., "reps": healthy attempts, "passes": attempts with reward >= success_reward,
     "failed": infrastructure failures, "mean_reward": ..., "parse_errors": replies of the
     task's attempts that did not parse (UNPARSED turns)}

`osworld_jax.data.freeze_band` reads this file to freeze the DAPO band.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from osworld_jax.data import TaskStream, load_task_refs, resolve_task_set
from osworld_jax.env import load_task
from osworld_jax.errors import ConfigError
from osworld_jax.rl import stages
from osworld_jax.rl.config import ExperimentConfig
from osworld_jax.rl.run import RolloutResources


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """The calibration lines and their summary.

    Attributes:
      lines: one dict per task (see the module docstring).
      pass_at_n: fraction of tasks with at least one pass.
      mean_pass_rate: mean over tasks of passes / reps.
    """

    lines: list[dict[str, Any]]
    pass_at_n: float
    mean_pass_rate: float


def evaluate(
    experiment: ExperimentConfig, run_dir: str | Path, out_path: str | Path, *, reps: int
) -> EvalResult:
    """Runs ``reps`` attempts of every task of ``experiment.data.task_set``; writes ``out_path``.

    The model is ``experiment.model`` served by the configured (or embedded) servers.
    """
    rl = dataclasses.replace(experiment.rl, num_owners=reps)
    exp = experiment.replace(rl=rl)
    refs = load_task_refs(resolve_task_set(exp.data.task_set))
    if exp.data.only_runnable:
        refs = [
            r for r in refs if stages.RunnableFilter(exp.backend, exp.cache_dir, exp.sandbox)(r)
        ]
    stream = TaskStream(refs, batch_size=rl.num_prompts, shuffle=False, num_epochs=1)
    lines: list[dict[str, Any]] = []
    with RolloutResources(exp, Path(run_dir)) as res:
        if res.client is None:
            raise ConfigError("evaluate runs in one process (it drives no trainer)")
        for tasks in stream:
            raw = res.runner.run(
                stages.rollout_step(
                    res.agent_env,
                    res.client,
                    res.tokenizer,
                    exp.agent,
                    exp.rollout.sampling,
                    tasks,
                    rl=rl,
                    step=len(lines),
                    load_task=load_task,
                )
            )
            for g, (ref, results) in enumerate(zip(raw.tasks, raw.results, strict=True)):
                lines.append(_line(ref.task_id, results, rl.success_reward, g))
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    tmp.replace(out)
    rates = [ln["passes"] / ln["reps"] for ln in lines if ln["reps"]]
    return EvalResult(
        lines=lines,
        pass_at_n=sum(ln["passes"] > 0 for ln in lines) / max(len(lines), 1),
        mean_pass_rate=sum(rates) / max(len(rates), 1),
    )


def _line(task_id: str, results: Any, success: float, group: int) -> dict[str, Any]:
    if isinstance(results, BaseException):
        return {
            "task_id": task_id,
            "reps": 0,
            "passes": 0,
            "failed": -1,
            "error": f"group {group}: {results!r}",
            "mean_reward": None,
            "parse_errors": 0,
        }
    healthy = [r.reward for r in results if not r.failed]
    return {
        "task_id": task_id,
        "reps": len(healthy),
        "passes": sum(r >= success for r in healthy),
        "failed": len(results) - len(healthy),
        "mean_reward": sum(healthy) / len(healthy) if healthy else None,
        "parse_errors": sum(r.num_parse_errors for r in results),
    }


__all__ = ["EvalResult", "evaluate"]
