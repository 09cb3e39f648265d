"""The OSWorld task format: loading and validation (no jax; imports nothing else from ``env/``).

An OSWorld task is a JSON object: ``id``, ``snapshot``, ``instruction``, ``source``, setup steps
``config`` (``{type, parameters}``), an ``evaluator`` (``func`` — one metric name or a list with
parallel ``result`` / ``expected`` / ``options`` lists combined by ``conj`` — ``result`` and
``expected`` getters ``{type, ...}``, and ``postconfig`` steps), plus ``proxy``, ``fixed_ip`` and
``possibility_of_env_change``. See xlang-ai/OSWorld ``evaluation_examples/``.

Loading checks the format only. Whether this package implements a task's step, getter and metric
types, and whether a backend can run it here, is ``osworld_jax.env.capabilities``' question.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from osworld_jax.errors import ConfigError


class TaskFormatError(ConfigError):
    """A task file is malformed; the message names the file and the field."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SetupStep:
    """One setup or postconfig step.

    Attributes:
      type: the step type (``download``, ``launch``, ``open``, ``execute``, ...).
      parameters: the step's parameters as in the JSON (treat as read-only).
    """

    type: str
    parameters: Mapping[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GetterSpec:
    """A ``result`` or ``expected`` getter of an evaluator.

    Attributes:
      type: the getter type (``vm_file``, ``rule``, ``vm_command_line``, ...).
      params: every other key of the getter object (treat as read-only).
    """

    type: str
    params: Mapping[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvaluatorSpec:
    """The evaluator, normalised to parallel tuples (a single ``func`` becomes a 1-tuple).

    Attributes:
      func: metric names.
      result: per metric, the getter of the observed value (None when the metric takes none,
        e.g. ``infeasible``).
      expected: per metric, the getter of the expected value, or None.
      options: per metric, keyword options of the metric.
      conj: how several metrics combine: ``"and"`` (all must score; the reward is their mean and
        0 if any is 0) or ``"or"`` (the maximum).
      postconfig: steps run after the episode, before the getters.
    """

    func: tuple[str, ...]
    result: tuple[GetterSpec | None, ...]
    expected: tuple[GetterSpec | None, ...]
    options: tuple[Mapping[str, Any], ...]
    conj: str
    postconfig: tuple[SetupStep, ...]

    @property
    def is_infeasible(self) -> bool:
        """Whether the task is scored by ``infeasible`` (reward 1 iff the agent answers FAIL)."""
        return self.func == ("infeasible",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Task:
    """One OSWorld task.

    Attributes:
      id: the task id (a UUID for the benchmark tasks).
      snapshot: the VM snapshot name the task starts from (e.g. ``"chrome"``).
      instruction: the natural-language instruction given to the agent.
      source: where the task came from (free text or URL).
      config: the setup steps, in order.
      evaluator: the evaluator.
      proxy: whether the task needs the benchmark's web proxy (live web).
      fixed_ip: whether the task needs a fixed IP address.
      possibility_of_env_change: upstream's note on how likely the live environment changed.
      related_apps: the applications the task involves.
      path: the file the task was loaded from, or None for a dict.
      domain: the task's domain (the parent directory name of its file, else ``snapshot``).
    """

    id: str
    snapshot: str
    instruction: str
    source: str
    config: tuple[SetupStep, ...]
    evaluator: EvaluatorSpec
    proxy: bool
    fixed_ip: bool
    possibility_of_env_change: str
    related_apps: tuple[str, ...]
    path: Path | None
    domain: str


def _fail(where: str, field: str, why: str) -> TaskFormatError:
    return TaskFormatError(f"{where}: field {field!r}: {why}")


def _step(raw: Any, where: str, field: str) -> SetupStep:
    if not isinstance(raw, Mapping):
        raise _fail(where, field, f"a step must be an object, got {type(raw).__name__}")
    typ = raw.get("type")
    if not isinstance(typ, str) or not typ:
        raise _fail(where, f"{field}.type", "a step needs a non-empty string 'type'")
    params = raw.get("parameters", {})
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise _fail(where, f"{field}.parameters", "must be an object")
    return SetupStep(type=typ, parameters=dict(params))


def _getter(raw: Any, where: str, field: str) -> GetterSpec | None:
    if raw is None or raw == {}:
        return None
    if not isinstance(raw, Mapping):
        raise _fail(where, field, f"a getter must be an object, got {type(raw).__name__}")
    typ = raw.get("type")
    if not isinstance(typ, str) or not typ:
        raise _fail(where, f"{field}.type", "a getter needs a non-empty string 'type'")
    return GetterSpec(type=typ, params={k: v for k, v in raw.items() if k != "type"})


def _parallel(raw: Any, n: int, listed: bool, where: str, field: str) -> list[Any]:
    """Normalises ``result``/``expected``/``options`` to a list parallel to ``func``."""
    if not listed:
        return [raw]
    if raw is None:
        return [None] * n
    if not isinstance(raw, list):
        # Upstream allows one object shared by every metric.
        return [raw] * n
    if len(raw) != n:
        raise _fail(where, field, f"has {len(raw)} entries but 'func' lists {n} metrics")
    return list(raw)


def _evaluator(raw: Any, where: str) -> EvaluatorSpec:
    if not isinstance(raw, Mapping):
        raise _fail(where, "evaluator", "missing or not an object")
    func = raw.get("func")
    listed = isinstance(func, list)
    funcs = func if listed else [func]
    if not funcs or not all(isinstance(f, str) and f for f in funcs):
        raise _fail(where, "evaluator.func", "must be a metric name or a non-empty list of names")
    n = len(funcs)
    results = [
        _getter(g, where, f"evaluator.result[{i}]")
        for i, g in enumerate(_parallel(raw.get("result"), n, listed, where, "evaluator.result"))
    ]
    expected = [
        _getter(g, where, f"evaluator.expected[{i}]")
        for i, g in enumerate(
            _parallel(raw.get("expected"), n, listed, where, "evaluator.expected")
        )
    ]
    options: list[Mapping[str, Any]] = []
    for i, o in enumerate(_parallel(raw.get("options"), n, listed, where, "evaluator.options")):
        if o is None:
            o = {}
        if not isinstance(o, Mapping):
            raise _fail(where, f"evaluator.options[{i}]", "must be an object")
        options.append(dict(o))
    conj = raw.get("conj", "and")
    if conj not in ("and", "or"):
        raise _fail(where, "evaluator.conj", f"must be 'and' or 'or', got {conj!r}")
    post = raw.get("postconfig", []) or []
    if not isinstance(post, list):
        raise _fail(where, "evaluator.postconfig", "must be a list of steps")
    return EvaluatorSpec(
        func=tuple(str(f) for f in funcs),
        result=tuple(results),
        expected=tuple(expected),
        options=tuple(options),
        conj=conj,
        postconfig=tuple(_step(s, where, f"evaluator.postconfig[{i}]") for i, s in enumerate(post)),
    )


def load_task(path_or_dict: str | os.PathLike[str] | Mapping[str, Any]) -> Task:
    """Loads and validates one OSWorld task.

    Args:
      path_or_dict: a task JSON file, or the already-parsed object.

    Returns:
      The task (step, getter and metric types are not checked against what this package
      implements: ``capabilities.unknown_types`` lists those it does not).

    Raises:
      TaskFormatError: bad JSON, a missing/ill-typed field, or a step without a type; the message
        names the file (or ``<dict>``) and the field.
    """
    path: Path | None = None
    if isinstance(path_or_dict, Mapping):
        raw: Any = path_or_dict
        where = f"<task dict {path_or_dict.get('id', '?')}>"
    else:
        path = Path(path_or_dict)
        where = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise TaskFormatError(f"{where}: cannot read: {e}") from e
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise TaskFormatError(f"{where}: field '<json>': bad JSON: {e}") from e
    if not isinstance(raw, Mapping):
        raise _fail(where, "<root>", "a task must be a JSON object")
    for key in ("id", "instruction"):
        val = raw.get(key)
        if not isinstance(val, str) or not val.strip():
            raise _fail(where, key, "missing or not a non-empty string")
    steps = raw.get("config", []) or []
    if not isinstance(steps, list):
        raise _fail(where, "config", "must be a list of steps")
    config = tuple(_step(s, where, f"config[{i}]") for i, s in enumerate(steps))
    ev = _evaluator(raw.get("evaluator"), where)
    apps = raw.get("related_apps", []) or []
    if not isinstance(apps, list):
        raise _fail(where, "related_apps", "must be a list")
    snapshot = str(raw.get("snapshot", "") or "")
    return Task(
        id=raw["id"],
        snapshot=snapshot,
        instruction=raw["instruction"],
        source=str(raw.get("source", "") or ""),
        config=config,
        evaluator=ev,
        proxy=bool(raw.get("proxy", False)),
        fixed_ip=bool(raw.get("fixed_ip", False)),
        possibility_of_env_change=str(raw.get("possibility_of_env_change", "") or ""),
        related_apps=tuple(str(a) for a in apps),
        path=path,
        domain=path.parent.name if path is not None else snapshot,
    )


def iter_task_files(root: str | os.PathLike[str]) -> Iterator[Path]:
    """Yields the task JSON files under ``root`` (``root/<domain>/<id>.json``), sorted.

    Files under an ``assets`` directory are task inputs, not tasks, and are skipped.
    """
    base = Path(root)
    yield from sorted(
        p
        for p in base.rglob("*.json")
        if p.is_file() and "assets" not in p.relative_to(base).parts[:-1]
    )


def load_tasks(root: str | os.PathLike[str]) -> list[Task]:
    """Loads every task under ``root`` (see ``iter_task_files``); the first bad file raises."""
    return [load_task(p) for p in iter_task_files(root)]
