"""Filling the local file cache: fetch, status and their CLI (see ``osworld_jax.env.cache``)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from osworld_jax.env.cache.keys import (
    CACHE_ENV_VAR,
    cache_keys,
    default_cache_dir,
    is_remote,
    remote_files,
    resolve,
)
from osworld_jax.env.tasks import Task, TaskFormatError, load_tasks

MANIFEST = "MANIFEST.json"

# --------------------------------------------------------------------------- fetching


class FetchError(Exception):
    """One file could not be fetched; the message names the URL and why."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FetchConfig:
    """How ``fetch`` downloads.

    Attributes:
      jobs: files downloaded at once.
      attempts: tries per file on transient failures (connection errors, 5xx, short bodies);
        each try resumes from what the previous one wrote.
      timeout_s: per-request deadline without progress (seconds between chunks).
      retry_delay_s: the first back-off between tries; it doubles per try (at most 8 s).
      mirrors: ``(from_prefix, to_prefix)`` URL rewrites applied before fetching.
      expected_sha256: url -> the file's SHA-256 (hex); a mismatch deletes the download.
      progress: show a progress bar (tqdm) on stderr.
    """

    jobs: int = 8
    attempts: int = 3
    timeout_s: float = 60.0
    retry_delay_s: float = 0.5
    mirrors: tuple[tuple[str, str], ...] = ()
    expected_sha256: Mapping[str, str] = dataclasses.field(default_factory=dict)
    progress: bool = True


@dataclasses.dataclass
class FetchResult:
    """What ``fetch`` did: URLs fetched, already present, and failed (url -> reason)."""

    fetched: list[str] = dataclasses.field(default_factory=list)
    present: list[str] = dataclasses.field(default_factory=list)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)


def _mirror(url: str, mirrors: Sequence[tuple[str, str]]) -> str:
    for src, dst in mirrors:
        if url.startswith(src):
            return dst + url[len(src) :]
    return url


_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def _server_sha256(headers: Mapping[str, str]) -> str | None:
    """The SHA-256 a server states for the body (Hugging Face: ``X-Linked-ETag`` / ``ETag``)."""
    for name in ("X-Linked-ETag", "ETag"):
        tag = headers.get(name, "").strip()
        tag = tag[2:] if tag.startswith("W/") else tag
        tag = tag.strip('"').lower()
        if _SHA256_HEX.match(tag):
            return tag
    return None


def _load_manifest(root: Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save_manifest(root: Path, manifest: Mapping[str, Any]) -> None:
    tmp = root / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, root / MANIFEST)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class _Progress:
    """A byte-counting progress bar over all files (tqdm), or nothing."""

    def __init__(self, enabled: bool, files: int) -> None:
        self.bar: Any = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(
                total=0, unit="B", unit_scale=True, desc=f"{files} files", file=sys.stderr
            )

    def add_total(self, n: int) -> None:
        if self.bar is not None and n > 0:
            self.bar.total += n
            self.bar.refresh()

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _range_starts_at(headers: Mapping[str, str], offset: int) -> bool:
    m = re.match(r"bytes (\d+)-", headers.get("Content-Range", ""))
    return m is not None and int(m.group(1)) == offset


class _Transient(Exception):
    """A failure worth another try (the ``.part`` file is kept)."""


async def _download_once(
    session: Any, url: str, part: Path, config: FetchConfig, progress: _Progress
) -> str | None:
    """One try: appends to ``part`` from where it ends; returns the server's stated SHA-256.

    Raises:
      _Transient: connection error, 5xx, or a body shorter than announced.
      FetchError: any other non-success reply (404, 403, ...).
    """
    import aiohttp

    have = part.stat().st_size if part.exists() else 0
    headers = {"Range": f"bytes={have}-"} if have else {}
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=config.timeout_s, sock_read=config.timeout_s
    )
    try:
        async with session.get(url, headers=headers, timeout=timeout) as resp:
            if resp.status == 416 and have:  # the .part already holds the whole file
                part.unlink()
                raise _Transient(f"{url}: range not satisfiable, restarting")
            if resp.status >= 500:
                raise _Transient(f"{url}: HTTP {resp.status}")
            if resp.status not in (200, 206):
                raise FetchError(f"{url}: HTTP {resp.status} {resp.reason or ''}".rstrip())
            if resp.status == 206 and not _range_starts_at(resp.headers, have):
                part.unlink(missing_ok=True)
                raise _Transient(f"{url}: the server resumed at the wrong offset, restarting")
            if resp.status == 200 and have:
                have = 0  # the server ignored the range: start over
            expected_len = resp.content_length
            total = have + expected_len if expected_len is not None else None
            progress.add_total(expected_len or 0)
            got = 0
            with part.open("ab" if have else "wb") as f:
                async for chunk in resp.content.iter_chunked(1 << 16):
                    f.write(chunk)
                    got += len(chunk)
                    progress.update(len(chunk))
            if expected_len is not None and got < expected_len:
                raise _Transient(f"{url}: body truncated at {have + got} of {total} bytes")
            return _server_sha256(resp.headers)
    except aiohttp.ClientPayloadError as e:
        size = part.stat().st_size if part.exists() else 0
        raise _Transient(f"{url}: body truncated at {size} bytes ({e})") from e
    except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
        raise _Transient(f"{url}: {type(e).__name__}: {e}") from e


async def _fetch_one(
    session: Any,
    url: str,
    root: Path,
    config: FetchConfig,
    progress: _Progress,
    manifest: dict[str, dict[str, Any]],
) -> None:
    key = cache_keys(url)[0]
    final, part = root / key, root / f"{key}.part"
    source = _mirror(url, config.mirrors)
    last = ""
    for attempt in range(config.attempts):
        try:
            stated = await _download_once(session, source, part, config, progress)
        except _Transient as e:
            last = str(e)
            if attempt + 1 < config.attempts:
                await asyncio.sleep(min(8.0, config.retry_delay_s * 2**attempt))
            continue
        digest = _sha256_file(part)
        want = config.expected_sha256.get(url) or stated
        if want is not None and digest != want.lower():
            part.unlink(missing_ok=True)
            raise FetchError(f"{url}: SHA-256 {digest} does not match the expected {want}")
        size = part.stat().st_size
        os.replace(part, final)
        manifest[url] = {"key": key, "sha256": digest, "size": size}
        return
    raise FetchError(
        f"{url}: failed after {config.attempts} tries ({last}); partial kept for resume"
    )


async def fetch_urls(
    urls: Iterable[str], cache_dir: str | os.PathLike[str], config: FetchConfig | None = None
) -> FetchResult:
    """Downloads every remote URL not yet cached into ``cache_dir`` (see the module docstring)."""
    import aiohttp

    config = config or FetchConfig()
    root = Path(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    result = FetchResult()
    todo = []
    for url in dict.fromkeys(urls):
        if not is_remote(url):
            continue
        if resolve(url, root) is not None:
            result.present.append(url)
        else:
            todo.append(url)
    manifest = _load_manifest(root)
    progress = _Progress(config.progress and bool(todo), len(todo))
    sem = asyncio.Semaphore(max(1, config.jobs))

    async def one(session: Any, url: str) -> None:
        async with sem:
            try:
                await _fetch_one(session, url, root, config, progress, manifest)
            except FetchError as e:
                result.failed[url] = str(e)
            else:
                result.fetched.append(url)

    try:
        async with aiohttp.ClientSession(trust_env=True) as session:
            await asyncio.gather(*(one(session, u) for u in todo))
    finally:
        progress.close()
        if result.fetched:
            _save_manifest(root, manifest)
    return result


# --------------------------------------------------------------------------- status


@dataclasses.dataclass
class CacheStatus:
    """How much of the tasks' remote files a cache holds.

    Attributes:
      needed: distinct remote URLs the tasks name.
      present: of those, the ones ``resolve`` finds.
      partial: missing ones with a ``.part`` download to resume.
      corrupt: present files whose SHA-256 differs from the manifest (``verify`` only).
      tasks_total: tasks naming at least one remote file.
      tasks_complete: of those, the ones with every file present.
    """

    needed: int = 0
    present: int = 0
    partial: int = 0
    corrupt: list[str] = dataclasses.field(default_factory=list)
    tasks_total: int = 0
    tasks_complete: int = 0


def cache_status(
    tasks: Sequence[Task], cache_dir: str | os.PathLike[str] | None, *, verify: bool = False
) -> CacheStatus:
    """Counts the tasks' remote files present in the cache (``verify``: re-hash them)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    manifest = _load_manifest(root) if verify else {}
    st = CacheStatus()
    seen: dict[str, bool] = {}
    for t in tasks:
        urls = [u for u in remote_files(t) if is_remote(u)]
        if not urls:
            continue
        st.tasks_total += 1
        ok = True
        for u in urls:
            if u not in seen:
                seen[u] = resolve(u, root, t.id) is not None
                if not seen[u] and (root / f"{cache_keys(u)[0]}.part").exists():
                    st.partial += 1
            ok = ok and seen[u]
        st.tasks_complete += ok
    st.needed = len(seen)
    st.present = sum(seen.values())
    for u, entry in manifest.items():
        p = root / str(entry.get("key", ""))
        if u in seen and p.is_file() and _sha256_file(p) != entry.get("sha256"):
            st.corrupt.append(u)
    return st


# --------------------------------------------------------------------------- CLI


def _read_expected(path: str | None) -> dict[str, str]:
    """``--manifest``: a JSON object url -> sha256 (or -> {"sha256": ...}, as MANIFEST.json)."""
    if path is None:
        return {}
    data = json.loads(Path(path).read_text())
    return {u: (v["sha256"] if isinstance(v, Mapping) else str(v)) for u, v in data.items()}


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``python -m osworld_jax.env.cache {fetch,status} TASKS_DIR [--cache-dir DIR]``."""
    parser = argparse.ArgumentParser(prog="python -m osworld_jax.env.cache")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, text in (
        ("fetch", "download every remote file the tasks name into the cache"),
        ("status", "count the tasks' remote files present in the cache"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("dir", help="a directory of task JSON files (<domain>/<id>.json)")
        p.add_argument("--cache-dir", default=None, help=f"default: ${CACHE_ENV_VAR} or ~/.cache")
    f = sub.choices["fetch"]
    f.add_argument("--jobs", type=int, default=8, help="files downloaded at once (default 8)")
    f.add_argument("--attempts", type=int, default=3, help="tries per file (default 3)")
    f.add_argument("--timeout", type=float, default=60.0, help="seconds without progress")
    f.add_argument("--mirror", action="append", default=[], metavar="FROM=TO",
                   help="fetch URLs starting with FROM from TO instead (repeatable)")  # fmt: skip
    f.add_argument("--manifest", default=None, help="JSON url -> sha256 to verify against")
    f.add_argument("--no-progress", action="store_true", help="no progress bar")
    sub.choices["status"].add_argument(
        "--verify", action="store_true", help="re-hash files against MANIFEST.json"
    )
    args = parser.parse_args(argv)
    root = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    try:
        tasks = load_tasks(args.dir)
    except (TaskFormatError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.cmd == "status":
        st = cache_status(tasks, root, verify=args.verify)
        print(
            f"cache {root}: {st.present}/{st.needed} remote files present"
            f" ({st.partial} partial); tasks with every file: {st.tasks_complete}/{st.tasks_total}"
        )
        for u in st.corrupt:
            print(f"  corrupt (SHA-256 differs from {MANIFEST}): {u}")
        return 1 if st.corrupt else 0
    mirrors = []
    for m in args.mirror:
        src, sep, dst = m.partition("=")
        if not sep or not src or not dst:
            print(f"error: --mirror {m!r}: expected FROM=TO", file=sys.stderr)
            return 2
        mirrors.append((src, dst))
    config = FetchConfig(
        jobs=args.jobs,
        attempts=args.attempts,
        timeout_s=args.timeout,
        mirrors=tuple(mirrors),
        expected_sha256=_read_expected(args.manifest),
        progress=not args.no_progress,
    )
    urls = [u for t in tasks for u in remote_files(t)]
    result = asyncio.run(fetch_urls(urls, root, config))
    print(
        f"fetched {len(result.fetched)}, already present {len(result.present)},"
        f" failed {len(result.failed)} (cache {root})"
    )
    for _url, why in sorted(result.failed.items()):
        print(f"  failed: {why}", file=sys.stderr)
    return 1 if result.failed else 0
