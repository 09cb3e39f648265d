"""The local file cache that stands in for OSWorld's remote file cache (no network here).

A task's ``download`` steps and ``cloud_file`` getters name URLs. Machines here cannot reach them,
so a URL resolves to a file of a local cache directory, found under one of these keys (first hit
wins):

1. ``<cache_dir>/<sha256(url) hex>`` — exact, collision free;
2. ``<cache_dir>/<repo path>`` — for a Hugging Face ``.../resolve/<rev>/<path>`` URL, the path
   inside the repository, so a local copy of ``xlangai/ubuntu_osworld_file_cache`` works as the
   cache directory as is (``<domain>/<task id>/<file>``);
3. ``<cache_dir>/<task id>/<url basename>`` — the layout OSWorld's own ``cache/`` uses;
4. ``<cache_dir>/<url basename>``.

A URL that resolves to nothing is reported by ``capabilities`` (task not runnable here) and, if a
setup step needs it anyway, raises ``SandboxCreateError`` naming the URL.
"""

from __future__ import annotations

import hashlib
import os
import re
import urllib.parse
from pathlib import Path

CACHE_ENV_VAR = "OSWORLD_JAX_FILE_CACHE"


def default_cache_dir() -> Path:
    """``$OSWORLD_JAX_FILE_CACHE`` or ``~/.cache/osworld_jax/files``."""
    env = os.environ.get(CACHE_ENV_VAR)
    if env:
        return Path(env)
    return Path.home() / ".cache" / "osworld_jax" / "files"


def url_basename(url: str) -> str:
    """The last path component of ``url`` (query and fragment dropped, %-escapes kept)."""
    return Path(urllib.parse.urlsplit(url).path).name


def cache_keys(url: str, task_id: str | None = None) -> list[str]:
    """The relative paths under which ``url`` may be cached, in look-up order."""
    keys = [hashlib.sha256(url.encode()).hexdigest()]
    path = urllib.parse.urlsplit(url).path
    m = re.search(r"/resolve/[^/]+/(.+)$", path)
    if m and ".." not in m.group(1).split("/"):
        keys.append(m.group(1))
    base = url_basename(url)
    if base:
        if task_id:
            keys.append(f"{task_id}/{base}")
        keys.append(base)
    return keys


def resolve(
    url: str,
    cache_dir: str | os.PathLike[str] | None,
    task_id: str | None = None,
    base_dir: str | os.PathLike[str] | None = None,
) -> Path | None:
    """Returns the cached file for ``url``, or None when it is not cached.

    A ``file://`` URL or an absolute local path resolves to itself when it exists; a relative path
    (no scheme) resolves against ``base_dir``, the task file's directory (bundled tasks ship their
    assets beside their JSON).
    """
    parsed = urllib.parse.urlsplit(url)
    if not parsed.scheme and not url.startswith("/"):
        if base_dir is None:
            return None
        p = Path(base_dir) / url
        return p if p.is_file() else None
    if parsed.scheme == "file":
        p = Path(urllib.parse.unquote(parsed.path))
        return p if p.is_file() else None
    if not parsed.scheme and url.startswith("/"):
        p = Path(url)
        return p if p.is_file() else None
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    for key in cache_keys(url, task_id):
        p = root / key
        if p.is_file():
            return p
    return None
