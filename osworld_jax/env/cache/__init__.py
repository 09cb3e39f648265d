"""The local file cache that stands in for OSWorld's remote file cache, and its fetcher (no jax).

A task's ``download`` steps, ``cloud_file`` getters and ``update_browse_history`` steps name
URLs (``remote_files``). The evaluators never use the network: a URL resolves to a file of a
local cache directory, found under one of these keys (first hit wins):

1. ``<cache_dir>/<sha256(url) hex>`` — exact, collision free (what ``fetch`` writes);
2. ``<cache_dir>/<repo path>`` — for a Hugging Face ``.../resolve/<rev>/<path>`` URL, the path
   inside the repository, so a local copy of ``xlangai/ubuntu_osworld_file_cache`` works as the
   cache directory as is (``<domain>/<task id>/<file>``);
3. ``<cache_dir>/<task id>/<url basename>`` — the layout OSWorld's own ``cache/`` uses;
4. ``<cache_dir>/<url basename>``.

Every key is relative and confined to the cache directory (empty and ``.`` components dropped,
``..`` refused, a task id is one path component). A URL that resolves to nothing is reported
by ``capabilities`` (task not runnable here) and, if a setup step needs it anyway,
raises ``SandboxCreateError`` naming the URL.

Filling the cache (on a machine with internet access)::

    python -m osworld_jax.env.cache fetch evaluation_examples/examples --cache-dir DIR
    python -m osworld_jax.env.cache status evaluation_examples/examples --cache-dir DIR

``fetch`` downloads every remote file the tasks name, ``--jobs`` at a time with a progress bar.
Each file is written to ``<key>.part`` and published by an atomic rename only when complete and
verified, so the cache never holds a partial or wrong file: an interrupted download resumes from
its ``.part`` (HTTP ``Range``); a reply shorter than its ``Content-Length`` is kept as ``.part``
for the next run; a file whose SHA-256 differs from the expected one (``--manifest``, or the
server's ``X-Linked-ETag``/``ETag`` when it is a SHA-256, as Hugging Face sends for its files) is
deleted. Verified files are recorded in ``<cache_dir>/MANIFEST.json`` (url -> sha256, size), which
``status --verify`` re-checks. A file is at most its expected size (``--manifest``'s ``size``) or
``--max-bytes``, and gets ``--deadline`` seconds in all; fetches of one file take its lock
(``<key>.lock``) so two processes never write it at once; ``.part`` files are never followed
through a symlink (see docs/SECURITY.md). ``--mirror FROM=TO`` fetches URLs starting with
``FROM`` from ``TO`` instead (a mirror of the file host); the cache key stays the task's URL.
"""

from osworld_jax.env.cache.fetch import (
    MANIFEST,
    CacheStatus,
    FetchConfig,
    FetchError,
    FetchResult,
    cache_status,
    fetch_urls,
    main,
)
from osworld_jax.env.cache.keys import (
    CACHE_ENV_VAR,
    HISTORY_EMPTY_URL,
    cache_keys,
    default_cache_dir,
    is_remote,
    remote_files,
    resolve,
    url_basename,
)

__all__ = [
    "CACHE_ENV_VAR",
    "HISTORY_EMPTY_URL",
    "MANIFEST",
    "CacheStatus",
    "FetchConfig",
    "FetchError",
    "FetchResult",
    "cache_keys",
    "cache_status",
    "default_cache_dir",
    "fetch_urls",
    "is_remote",
    "main",
    "remote_files",
    "resolve",
    "url_basename",
]
