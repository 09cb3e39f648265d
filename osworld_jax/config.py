"""gin at the edge: bind every room's config dataclass from gin files, build `ExperimentConfig`.

The only library module that imports gin. Files bind ``ClassName.field = value`` (T5X
convention: ``--gin_file`` repeatable, later files override earlier ones, ``--gin_param``
bindings are applied after every file)::

    parse_gin(["configs/osworld_flash_b8n8_r3_dr_grpo.gin"], ["RLConfig.steps = 2"])
    experiment = build_experiment()
    write_operative_config(run_dir)

`build_experiment` calls each config class through gin; a dataclass-typed field that no binding
sets (``RolloutConfig.sampling``, ``TrainerConfig.optimizer``, ...) is itself built from its own
class's bindings, so ``SamplingParams.temperature = 0.7`` reaches ``experiment.rollout.sampling``.
Every mistake fails at start-up with ONE line naming the file, the line and the binding: an
unknown class or field (gin's error, rewritten), a value of the wrong type (checked against the
field's annotation), or a value a config's own validation rejects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gin
from gin import config_parser

from osworld_jax.agent.config import AgentConfig, CompactionConfig, GroupPolicyConfig
from osworld_jax.algorithms import LossConfig
from osworld_jax.data import DataConfig
from osworld_jax.env import BACKENDS, AgentEnvConfig
from osworld_jax.errors import ConfigError
from osworld_jax.model.config import ModelRuntimeConfig
from osworld_jax.rl.config import (
    ExperimentConfig,
    MeshConfig,
    ModelSourceConfig,
    RLConfig,
    ServerConfig,
)
from osworld_jax.rl.rundir import OPERATIVE_CONFIG, RESOLVED_CONFIG, write_run_config
from osworld_jax.rollout.config import (
    RolloutConfig,
    SamplingParams,
    SGLangLaunchConfig,
    SGLangRefitConfig,
)
from osworld_jax.trainer.config import CheckpointConfig, OptimizerConfig, TrainerConfig
from osworld_jax.trainer.distributed import DistributedConfig

#: Every config class gin can bind (by class name, or ``module.ClassName``); each sandbox
#: backend's config class comes from the backend registry.
CONFIGURABLES: tuple[type, ...] = (
    ExperimentConfig,
    ModelSourceConfig,
    ModelRuntimeConfig,
    TrainerConfig,
    LossConfig,
    OptimizerConfig,
    CheckpointConfig,
    RolloutConfig,
    SamplingParams,
    ServerConfig,
    SGLangLaunchConfig,
    SGLangRefitConfig,
    AgentEnvConfig,
    *BACKENDS.config_classes(),
    AgentConfig,
    CompactionConfig,
    GroupPolicyConfig,
    DataConfig,
    RLConfig,
    MeshConfig,
    DistributedConfig,
)
#: The repository's ``configs/`` directory: ``--gin_file=grpo.gin`` and gin ``include`` find
#: files there.
CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"
OPERATIVE_CONFIG_NAME = OPERATIVE_CONFIG
RESOLVED_CONFIG_NAME = RESOLVED_CONFIG

_registered = False
# binding "Class.field" -> "file:line" of the binding that set its current value.
_locations: dict[str, str] = {}


def register_configurables() -> None:
    """Registers `CONFIGURABLES` with gin (idempotent)."""
    global _registered
    if _registered:
        return
    for cls in CONFIGURABLES:
        gin.register(cls, module=cls.__module__)
    gin.add_config_file_search_path(str(CONFIGS_DIR))
    _registered = True


def parse_gin(files: Sequence[str | Path] = (), params: Sequence[str] = ()) -> None:
    """Clears gin, then parses ``files`` in order and ``params`` after them.

    Raises:
      ConfigError: one line ``<file>:<line>: <binding>: <problem>`` for a missing file, a syntax
        error, an unknown class or an unknown field.
    """
    register_configurables()
    gin.clear_config()
    _locations.clear()
    for f in files:
        path = _find_config_file(str(f))
        _parse_one(lambda p=path: gin.parse_config_file(p), str(path), path.read_text())
        _record_locations(path.read_text(), str(path))
    for i, param in enumerate(params):
        where = f"--gin_param[{i}]"
        _parse_one(lambda param=param: gin.parse_config(param), where, param)
        _record_locations(param, where)


def build(cls: type) -> Any:
    """Builds the registered config class ``cls`` from the current bindings (recursively)."""
    hints = typing.get_type_hints(cls)
    name = cls.__name__
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        key = f"{name}.{f.name}"
        try:
            value = gin.query_parameter(key)
        except ValueError:  # not bound: a nested config is built from its own class's bindings
            sub = _config_class(hints[f.name]) or _default_config_class(f)
            if sub is not None:
                kwargs[f.name] = build(sub)
            continue
        if not _matches(value, hints[f.name]):
            raise ConfigError(
                f"{_where(key)}{key} = {value!r}: expected {_expected_form(hints[f.name])}"
            )
    try:
        return gin.get_configurable(cls)(**kwargs)
    except ConfigError as e:
        raise ConfigError(_locate(str(e))) from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{name}: {_first_line(str(e))}") from None


def build_experiment() -> ExperimentConfig:
    """The `ExperimentConfig` of the current bindings (call `parse_gin` first)."""
    return build(ExperimentConfig)


def load_experiment(
    files: Sequence[str | Path] = (), params: Sequence[str] = ()
) -> ExperimentConfig:
    """`parse_gin` then `build_experiment`."""
    parse_gin(files, params)
    return build_experiment()


def operative_config() -> str:
    """The operative gin config: the bindings the built configs actually used."""
    return gin.operative_config_str()


def write_operative_config(run_dir: str | Path, experiment: ExperimentConfig) -> Path:
    """Writes ``operative_config.gin`` and the resolved ``experiment.json`` into ``run_dir``.

    ``scripts/train.py`` does not call it: the run writes both once it is starting
    (``train(..., operative_gin=operative_config())``), so a failed start leaves them alone.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_run_config(run_dir, experiment, operative_config())
    return run_dir / OPERATIVE_CONFIG_NAME


# ---------------------------------------------------------------------------------------------


def _find_config_file(name: str) -> Path:
    for candidate in (Path(name), CONFIGS_DIR / name):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"--gin_file {name}: no such file (also looked in {CONFIGS_DIR})")


def _parse_one(parse: Any, where: str, text: str) -> None:
    try:
        with _quiet_search_misses():
            parse()
    except (ValueError, SyntaxError, OSError, ImportError) as e:
        raise ConfigError(_gin_error_line(e, where, text)) from None


_BINDING = re.compile(r"^\s*(?:[\w.]+/)*(?:[\w]+\.)*([A-Za-z_]\w*)\.(\w+)\s*=\s*(.*?)\s*$")


def _classes() -> dict[str, type]:
    return {cls.__name__: cls for cls in CONFIGURABLES}


def _did_you_mean(name: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _expected_form(hint: Any) -> str:
    """How a value of the annotation ``hint`` is written in gin, e.g. ``a quoted string``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(_expected_form(a) for a in args))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if hint is type(None):
        return "None"
    forms = {
        str: "a quoted string, e.g. 'text'",
        bool: "True or False",
        int: "an integer, e.g. 8",
        float: "a number, e.g. 1e-05",
    }
    if hint in forms:
        return forms[hint]
    if origin in (tuple, list):
        return f"a {origin.__name__}, e.g. (1, 2)" if origin is tuple else "a list, e.g. [1, 2]"
    if origin is dict:
        return "a dict, e.g. {'key': 1}"
    if _config_class(hint) is not None:
        return f"a @{hint.__name__}() reference"
    return _type_name(hint)


def _diagnose(source_line: str) -> str | None:
    """What is wrong with the binding ``source_line`` whose value gin cannot parse, or None."""
    m = _BINDING.match(source_line)
    if m is None:
        return None
    cls_name, field, value = m.groups()
    cls = _classes().get(cls_name)
    hint = None
    if cls is not None and field in {f.name for f in dataclasses.fields(cls)}:
        hint = typing.get_type_hints(cls)[field]
    expected = f"; expected {_expected_form(hint)}" if hint is not None else ""
    unquoted = re.fullmatch(r"[\w./~:+-]+", value) is not None and not re.fullmatch(
        r"[+-]?[\d.]+(?:e[+-]?\d+)?", value, re.IGNORECASE
    )
    if unquoted and not value[:1].isdigit():
        return f"{value} is not a value: strings need quotes, e.g. {cls_name}.{field} = '{value}'"
    if not value:
        return f"no value after '='{expected}"
    if value[0] in "'\"" and value.count(value[0]) % 2:
        return f"{value} has no closing quote{expected}"
    return f"{value!r} is not a Python literal{expected}"


def _unknown_name(cause: str) -> str | None:
    """The ``did you mean`` of gin's unknown-class / unknown-field errors, or None."""
    m = re.search(r"No configurable matching '([^']+)'", cause)
    if m:
        name = m.group(1).rsplit(".", 1)[-1]
        return f"{cause.rstrip('.')}{_did_you_mean(name, list(_classes()))}"
    m = re.search(r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'", cause)
    cls = _classes().get(m.group(1).rsplit(".", 1)[-1]) if m else None
    if m and cls is not None:
        fields = [f.name for f in dataclasses.fields(cls)]
        hint = _did_you_mean(m.group(2), fields)
        if hint:
            return f"{cause.rstrip('.')}{hint.replace('mean ', f'mean {cls.__name__}.')}"
        # the field of another configurable (RLConfig.learning_rate is OptimizerConfig's)
        elsewhere = [f"{c.__name__}.{f.name}" for c in CONFIGURABLES for f in dataclasses.fields(c)]
        by_field = {b.split(".", 1)[1]: b for b in reversed(elsewhere)}
        close = difflib.get_close_matches(m.group(2), list(by_field), n=1, cutoff=0.75)
        return f"{cause.rstrip('.')}" + (f"; did you mean {by_field[close[0]]}?" if close else "")
    return None


class _SearchMissFilter(logging.Filter):
    """Drops gin's resource reader's ``Path not found`` records.

    gin looks an ``include``d name up in every search path in turn and its package-resource
    reader logs an ERROR for each path that misses, although the file is then found in a later
    one (the ``configs/`` directory): not an error. A file found nowhere still fails loudly.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        miss = str(record.msg).startswith("Path not found")
        return not (miss and record.pathname.endswith("resource_reader.py"))


@contextlib.contextmanager
def _quiet_search_misses() -> Any:
    root, miss = logging.getLogger(), _SearchMissFilter()
    root.addFilter(miss)
    try:
        yield
    finally:
        root.removeFilter(miss)


def _record_locations(text: str, where: str) -> None:
    """Remembers ``file:line`` of each binding of ``text`` (included files followed).

    Read with gin's own public parser (``gin.config_parser``), statement by statement, so a
    later binding of the same key (or one after an ``include``) wins as it does in gin.
    """
    delegate = gin.config.ParserDelegate(skip_unknown=True)
    for statement in config_parser.ConfigParser(text, delegate):
        if isinstance(statement, config_parser.BindingStatement):
            short = statement.selector.rsplit(".", 1)[-1]
            key = f"{short}.{statement.arg_name}"
            _locations[key] = f"{where}:{statement.location.line_num}"
        elif isinstance(statement, config_parser.IncludeStatement):
            included = _find_config_file(statement.filename)
            _record_locations(included.read_text(), str(included))


def _gin_error_line(e: BaseException, where: str, text: str = "") -> str:
    msg = str(e)
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    cause = re.sub(r"\s*\([^()]*line \d+\)$", "", lines[0]) if lines else type(e).__name__
    m = re.search(r'In file "([^"]+)", line (\d+)', msg)
    if m:
        loc = f"{m.group(1)}:{m.group(2)}"
    else:
        m2 = re.search(r"(?:bindings string )?line (\d+)", msg)
        lineno = getattr(e, "lineno", None) or (int(m2.group(1)) if m2 else None)
        loc = f"{where}:{lineno}" if lineno else where
    binding = ""
    for ln in lines[1:]:
        if "=" in ln and not ln.startswith("In "):
            binding = ln
            break
    cause = _unknown_name(cause) or cause
    if not binding and isinstance(e, SyntaxError | ValueError):  # a value gin cannot parse
        source = _source_line(loc, text, where)
        found = _diagnose(source) if source else None
        if source is not None and found is not None:
            binding, cause = source.strip(), found
    return f"{loc}: {binding + ': ' if binding else ''}{cause}"


def _source_line(loc: str, text: str, where: str) -> str | None:
    """The text of line ``<file>:<n>`` (``loc``); ``text`` is that of ``where``."""
    file, _, n = loc.rpartition(":")
    if not n.isdigit():
        return None
    if file != where:
        try:
            text = Path(file).read_text()
        except OSError:
            return None
    lines = text.splitlines()
    return lines[int(n) - 1] if 0 < int(n) <= len(lines) else None


def _where(key: str) -> str:
    return f"{_locations[key]}: " if key in _locations else ""


def _locate(message: str) -> str:
    """Prefixes a config's own validation error with the location of the binding it names."""
    message = _first_line(message)
    for m in re.finditer(r"\b([A-Z]\w*)\.(\w+)", message):
        key = f"{m.group(1)}.{m.group(2)}"
        if key in _locations:
            return f"{_locations[key]}: {message}"
    return message


def _first_line(s: str) -> str:
    return s.strip().splitlines()[0] if s.strip() else s


def _default_config_class(f: dataclasses.Field) -> type | None:
    """The config class of a field's default value (e.g. ``sandbox``: ``LocalBackendConfig``)."""
    if f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
        return None
    cls = type(f.default_factory())  # type: ignore[misc]
    return cls if cls in CONFIGURABLES else None


def _config_class(hint: Any) -> type | None:
    if isinstance(hint, type) and dataclasses.is_dataclass(hint) and hint in CONFIGURABLES:
        return hint
    return None


def _matches(value: Any, hint: Any) -> bool:
    """A light structural check of a bound value against a field annotation."""
    if hint is Any or isinstance(value, gin.config.ConfigurableReference):
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return value in args
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is tuple:
        if not isinstance(value, tuple | list):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_matches(v, args[0]) for v in value)
        return len(args) == len(value) and all(
            _matches(v, a) for v, a in zip(value, args, strict=True)
        )
    if origin is list:
        return isinstance(value, list | tuple) and all(_matches(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
