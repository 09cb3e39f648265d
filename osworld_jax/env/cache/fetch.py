"""Filling the local file cache: fetch, status and their CLI (see ``osworld_jax.env.cache``)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import stat
import sys
import tempfile
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
      expected_size: url -> the file's size in bytes; a longer body is cut off and deleted.
      max_bytes: the largest file fetched when its size is not expected (a longer body, or a
        ``Content-Length`` above it, fails the file and deletes the download).
      deadline_s: the most seconds one file may take, all tries and waits for its lock included;
        then it fails, its ``.part`` kept for the next run.
      progress: show a progress bar (tqdm) on stderr.
    """

    jobs: int = 8
    attempts: int = 3
    timeout_s: float = 60.0
    retry_delay_s: float = 0.5
    mirrors: tuple[tuple[str, str], ...] = ()
    expected_sha256: Mapping[str, str] = dataclasses.field(default_factory=dict)
    expected_size: Mapping[str, int] = dataclasses.field(default_factory=dict)
    max_bytes: int = 4 << 30
    deadline_s: float = 3600.0
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


_NOFOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _open_regular(path: Path, flags: int) -> int:
    """``os.open`` that never follows a symlink and accepts only a regular file.

    Raises:
      FetchError: ``path`` is a symlink, a FIFO, a directory... (something planted in the cache
        directory; nothing is written through it).
    """
    try:
        fd = os.open(path, flags | _NOFOLLOW, 0o644)
    except OSError as e:
        kind = "a symlink" if path.is_symlink() else os.strerror(e.errno or 0)
        raise FetchError(f"{path}: {kind}; not written through (remove it)") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FetchError(f"{path}: not a regular file; not written through (remove it)")
    os.set_blocking(fd, True)
    return fd


class _Lock:
    """An exclusive ``flock`` on the file ``path`` (never followed), removed on release.

    The holder unlinks the file before closing it; a waiter that then gets the lock of the
    unlinked file sees that ``path`` is no longer its file and starts over.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1

    async def __aenter__(self) -> _Lock:
        while True:  # the caller's deadline bounds this wait
            fd = _open_regular(self.path, os.O_RDWR | os.O_CREAT)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        await asyncio.sleep(0.05)
            except BaseException:  # the deadline (cancelled while waiting)
                os.close(fd)
                raise
            try:
                still = os.lstat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                still = False
            if still:
                self.fd = fd
                return self
            os.close(fd)

    async def __aexit__(self, *exc: object) -> None:
        self.path.unlink(missing_ok=True)
        os.close(self.fd)  # releases the lock


def _save_manifest(root: Path, entries: Mapping[str, Any]) -> None:
    """Adds ``entries`` to MANIFEST.json, re-reading what others published since.

    Under a ``flock`` of the cache directory itself: one writer of the manifest at a time.
    """
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        manifest = {**_load_manifest(root), **entries}
        tmp_fd, tmp = tempfile.mkstemp(prefix=f".{MANIFEST}.", suffix=".tmp", dir=root)
        try:  # a fresh name made exclusively: nothing planted is written through
            with os.fdopen(tmp_fd, "w") as f:
                f.write(json.dumps(manifest, indent=1, sort_keys=True))
            os.chmod(tmp, 0o644)
            os.replace(tmp, root / MANIFEST)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    finally:
        os.close(fd)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with os.fdopen(_open_regular(path, os.O_RDONLY), "rb") as f:
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


def _size_limit(url: str, config: FetchConfig) -> int:
    expected = config.expected_size.get(url)
    return int(expected) if expected is not None else config.max_bytes


async def _download_once(
    session: Any, url: str, part: Path, limit: int, config: FetchConfig, progress: _Progress
) -> str | None:
    """One try: appends to ``part`` from where it ends; returns the server's stated SHA-256.

    ``part`` is opened without following symlinks; a body that would make it longer than
    ``limit`` bytes deletes it and fails the file.

    Raises:
      _Transient: connection error, 5xx, or a body shorter than announced.
      FetchError: any other non-success reply (404, 403, ...), a body over ``limit``.
    """
    import aiohttp

    fd = _open_regular(part, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        have = os.fstat(fd).st_size
        headers = {"Range": f"bytes={have}-"} if have else {}
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=config.timeout_s, sock_read=config.timeout_s
        )
        async with session.get(url, headers=headers, timeout=timeout) as resp:
            if resp.status == 416 and have:  # the .part already holds the whole file
                os.ftruncate(fd, 0)
                raise _Transient(f"{url}: range not satisfiable, restarting")
            if resp.status >= 500:
                raise _Transient(f"{url}: HTTP {resp.status}")
            if resp.status not in (200, 206):
                raise FetchError(f"{url}: HTTP {resp.status} {resp.reason or ''}".rstrip())
            if resp.status == 206 and not _range_starts_at(resp.headers, have):
                os.ftruncate(fd, 0)
                raise _Transient(f"{url}: the server resumed at the wrong offset, restarting")
            if resp.status == 200 and have:
                os.ftruncate(fd, 0)  # the server ignored the range: start over
                have = 0
            expected_len = resp.content_length
            total = have + expected_len if expected_len is not None else None
            if total is not None and total > limit:
                part.unlink(missing_ok=True)
                raise FetchError(f"{url}: {total} bytes announced, more than the {limit} allowed")
            progress.add_total(expected_len or 0)
            got = 0
            async for chunk in resp.content.iter_chunked(1 << 16):
                if have + got + len(chunk) > limit:
                    part.unlink(missing_ok=True)
                    raise FetchError(f"{url}: the body exceeds the {limit} bytes allowed")
                os.write(fd, chunk)
                got += len(chunk)
                progress.update(len(chunk))
            if expected_len is not None and got < expected_len:
                raise _Transient(f"{url}: body truncated at {have + got} of {total} bytes")
            return _server_sha256(resp.headers)
    except aiohttp.ClientPayloadError as e:
        raise _Transient(f"{url}: body truncated at {os.fstat(fd).st_size} bytes ({e})") from e
    except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
        raise _Transient(f"{url}: {type(e).__name__}: {e}") from e
    finally:
        empty = os.fstat(fd).st_size == 0
        os.close(fd)
        if empty:  # nothing to resume from
            part.unlink(missing_ok=True)


async def _fetch_one(
    session: Any,
    url: str,
    root: Path,
    config: FetchConfig,
    progress: _Progress,
    manifest: dict[str, dict[str, Any]],
) -> bool:
    """Fetches ``url`` into the cache under its key's lock; False if another fetch published it.

    Raises:
      FetchError: the file failed (the message says why); nothing is published.
    """
    key = cache_keys(url)[0]
    try:
        async with asyncio.timeout(config.deadline_s):
            async with _Lock(root / f"{key}.lock"):
                return await _fetch_locked(url, key, session, root, config, progress, manifest)
    except TimeoutError:
        raise FetchError(
            f"{url}: not complete after {config.deadline_s:g} s (deadline_s); partial kept"
        ) from None


async def _fetch_locked(
    url: str,
    key: str,
    session: Any,
    root: Path,
    config: FetchConfig,
    progress: _Progress,
    manifest: dict[str, dict[str, Any]],
) -> bool:
    final, part = root / key, root / f"{key}.part"
    if final.is_file() and not final.is_symlink():
        return False  # another fetch published it while this one waited for the lock
    source = _mirror(url, config.mirrors)
    limit = _size_limit(url, config)
    last = ""
    for attempt in range(config.attempts):
        try:
            stated = await _download_once(session, source, part, limit, config, progress)
        except _Transient as e:
            last = str(e)
            if attempt + 1 < config.attempts:
                await asyncio.sleep(min(8.0, config.retry_delay_s * 2**attempt))
            continue
        digest = _sha256_file(part)  # verified before it is published (file and manifest)
        want = config.expected_sha256.get(url) or stated
        if want is not None and digest != want.lower():
            part.unlink(missing_ok=True)
            raise FetchError(f"{url}: SHA-256 {digest} does not match the expected {want}")
        size = part.stat().st_size
        if url in config.expected_size and size != config.expected_size[url]:
            part.unlink(missing_ok=True)
            raise FetchError(f"{url}: {size} bytes, expected {config.expected_size[url]}")
        os.replace(part, final)
        manifest[url] = {"key": key, "sha256": digest, "size": size}
        return True
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
    manifest: dict[str, dict[str, Any]] = {}  # this call's entries, merged in on save
    progress = _Progress(config.progress and bool(todo), len(todo))
    sem = asyncio.Semaphore(max(1, config.jobs))

    async def one(session: Any, url: str) -> None:
        async with sem:
            try:
                fetched = await _fetch_one(session, url, root, config, progress, manifest)
            except FetchError as e:
                result.failed[url] = str(e)
            except OSError as e:  # e.g. a directory planted at the key: one line, not a traceback
                result.failed[url] = f"{url}: {e}"
            else:
                (result.fetched if fetched else result.present).append(url)

    try:
        async with aiohttp.ClientSession(trust_env=True) as session:
            await asyncio.gather(*(one(session, u) for u in todo))
    finally:
        progress.close()
        if manifest:
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


def _read_expected(path: str | None) -> tuple[dict[str, str], dict[str, int]]:
    """``--manifest``: (url -> sha256, url -> size) from a JSON object of url -> sha256 entries.

    An entry may also be {"sha256": ..., "size": ...}, as MANIFEST.json writes them.

    Raises:
      FetchError: one line naming the file and what is wrong with it.
    """
    if path is None:
        return {}, {}
    try:
        data = json.loads(Path(path).read_bytes())
    except OSError as e:
        raise FetchError(f"--manifest {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise FetchError(f"--manifest {path}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise FetchError(f"--manifest {path}: expected a JSON object url -> sha256")
    shas: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for u, v in data.items():
        sha, size = (v.get("sha256"), v.get("size")) if isinstance(v, dict) else (v, None)
        if not isinstance(sha, str) or not _SHA256_HEX.match(sha.lower()):
            raise FetchError(f"--manifest {path}: {u!r}: not a SHA-256 hex digest: {sha!r}")
        if size is not None and (type(size) is not int or size < 0):
            raise FetchError(f"--manifest {path}: {u!r}: size must be a whole number: {size!r}")
        shas[u] = sha.lower()
        if size is not None:
            sizes[u] = size
    return shas, sizes


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
    f.add_argument("--max-bytes", type=int, default=FetchConfig.max_bytes,
                   help="largest file without an expected size (default 4 GiB)")  # fmt: skip
    f.add_argument("--deadline", type=float, default=FetchConfig.deadline_s,
                   help="most seconds per file, all tries included (default 3600)")  # fmt: skip
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
    try:
        expected_sha256, expected_size = _read_expected(args.manifest)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    config = FetchConfig(
        jobs=args.jobs,
        attempts=args.attempts,
        timeout_s=args.timeout,
        mirrors=tuple(mirrors),
        expected_sha256=expected_sha256,
        expected_size=expected_size,
        max_bytes=args.max_bytes,
        deadline_s=args.deadline,
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
