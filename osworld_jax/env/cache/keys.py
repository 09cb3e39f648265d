"""Where a task's remote file lives in the local cache (see ``osworld_jax.env.cache``)."""

from __future__ import annotations

import hashlib
import os
import re
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from osworld_jax.env.tasks import Task

CACHE_ENV_VAR = "OSWORLD_JAX_FILE_CACHE"
# The empty Chrome history upstream's ``update_browse_history`` step fills in.
HISTORY_EMPTY_URL = (
    "https://huggingface.co/datasets/xlangai/ubuntu_osworld_file_cache/resolve/main/chrome/"
    "44ee5668-ecd5-4366-a6ce-c1c9b8d4e938/history_empty.sqlite?download=true"
)


def default_cache_dir() -> Path:
    """``$OSWORLD_JAX_FILE_CACHE`` or ``~/.cache/osworld_jax/files``."""
    env = os.environ.get(CACHE_ENV_VAR)
    if env:
        return Path(env)
    return Path.home() / ".cache" / "osworld_jax" / "files"


def url_basename(url: str) -> str:
    """The last path component of ``url`` (query and fragment dropped, %-escapes kept)."""
    return Path(urllib.parse.urlsplit(url).path).name


def _confined(path: str) -> str | None:
    """``path`` as a relative key that stays inside its directory, or None when it cannot.

    Empty and ``.`` components are dropped (``resolve/main//etc/passwd`` -> ``etc/passwd``);
    a ``..`` component (it would leave the directory) or a NUL byte refuse the key.
    """
    if "\x00" in path:
        return None
    parts = [c for c in path.split("/") if c not in ("", ".")]
    if not parts or ".." in parts:
        return None
    return "/".join(parts)


def cache_keys(url: str, task_id: str | None = None) -> list[str]:
    """The relative paths under which ``url`` may be cached, in look-up order.

    Every key is confined: relative, without ``..`` (a URL or task id that would make a key
    leave the cache directory gives no such key; the SHA-256 key always exists).
    """
    keys = [hashlib.sha256(url.encode()).hexdigest()]
    path = urllib.parse.urlsplit(url).path
    m = re.search(r"/resolve/[^/]+/(.+)$", path)
    if m and (repo_path := _confined(m.group(1))) is not None:
        keys.append(repo_path)
    base = _confined(url_basename(url))
    if base is not None:
        task_dir = _confined(task_id) if task_id else None
        if task_dir is not None and "/" not in task_dir:  # a task id is one path component
            keys.append(f"{task_dir}/{base}")
        keys.append(base)
    return list(dict.fromkeys(keys))


def is_remote(url: str) -> bool:
    """Whether ``url`` names a file on the network (http/https), not a local or bundled one."""
    return urllib.parse.urlsplit(url).scheme in ("http", "https")


def resolve(
    url: str,
    cache_dir: str | os.PathLike[str] | None,
    task_id: str | None = None,
    base_dir: str | os.PathLike[str] | None = None,
) -> Path | None:
    """Returns the cached file for ``url``, or None when it is not cached.

    A ``file://`` URL or an absolute local path resolves to itself when it exists (task files are
    trusted: they may name host files); a relative path (no scheme) resolves against ``base_dir``,
    the task file's directory (bundled tasks ship their assets beside their JSON), and never leaves
    it (``..`` gives None). A remote URL resolves only inside ``cache_dir`` (see `cache_keys`).
    """
    parsed = urllib.parse.urlsplit(url)
    if not parsed.scheme and not url.startswith("/"):
        if base_dir is None:
            return None
        rel = _confined(url)  # a bundled asset lives beside (below) its task file
        if rel is None:
            return None
        p = Path(base_dir) / rel
        return p if p.is_file() else None
    if parsed.scheme == "file":
        p = Path(urllib.parse.unquote(parsed.path))
        return p if p.is_file() else None
    if not parsed.scheme and url.startswith("/"):
        p = Path(url)
        return p if p.is_file() else None
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    for key in cache_keys(url, task_id):  # each key is relative and has no ``..``
        p = root / key
        if p.is_file():
            return p
    return None


def remote_files(task: Task) -> list[str]:
    """The URLs of the files ``task`` needs from the file cache, in task order, no repeats.

    ``download`` steps (setup and postconfig), ``cloud_file`` getters, and the empty history
    database of ``update_browse_history`` steps. Bundled tasks' relative paths are included (they
    resolve beside the task file); ``fetch`` skips them.
    """
    urls: list[Any] = []
    for s in (*task.config, *task.evaluator.postconfig):
        if s.type == "download":
            for f in s.parameters.get("files", []) or []:
                if isinstance(f, Mapping):
                    urls.append(f.get("url"))
        elif s.type == "update_browse_history":
            urls.append(HISTORY_EMPTY_URL)
    for g in (*task.evaluator.result, *task.evaluator.expected):
        if g is not None and g.type == "cloud_file":
            paths = g.params.get("path")
            urls.extend(paths if isinstance(paths, list) else [paths])
    return list(dict.fromkeys(u for u in urls if isinstance(u, str) and u))
