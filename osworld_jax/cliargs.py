"""The project's command lines: a wrong value is one line and exit 2, before anything starts.

argparse prints the whole usage before its error, so a typo scrolls out of sight behind a
screenful; `ArgumentParser` prints one line instead, ``<prog>: error: <what> (see <prog>
--help)``. The value types below refuse what a command cannot use (a non-positive count, a
missing input, an output that would overwrite a directory) as argparse refuses an unknown
choice: ``argument --reps: must be a positive integer, got '0'``. No jax: every entry point uses
this before its heavy imports.
"""

from __future__ import annotations

import argparse
import urllib.parse
from pathlib import Path
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line (subcommands' parsers too)."""

    def error(self, message: str) -> NoReturn:
        """Prints ``<prog>: error: <message> (see <prog> --help)`` to stderr and exits 2."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """An integer >= 1 (``--reps``, ``--steps``)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def existing_dir(text: str) -> Path:
    """A directory that exists."""
    path = Path(text).expanduser()
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"{text} {what}")
    return path


def dir_path(text: str) -> Path:
    """A directory that may not exist yet (a cache the command fills), never a file."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a directory")
    return path


def existing_file(text: str) -> Path:
    """A file that exists."""
    path = Path(text).expanduser()
    if not path.is_file():
        what = "is not a file" if path.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"{text} {what}")
    return path


def output_file(text: str) -> Path:
    """A file to write: not a directory, in a directory that exists."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory, not a file to write")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: its directory {path.parent} does not exist")
    return path


def new_dir(text: str) -> Path:
    """A directory to create: nothing there yet (its parents are created)."""
    path = Path(text).expanduser()
    if path.exists():
        raise argparse.ArgumentTypeError(f"{text} already exists (name a new directory)")
    return path


def run_dir(text: str) -> Path:
    """A run directory: an existing directory or a path to create, never a file."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a run directory")
    return path


def model_dir(text: str) -> str:
    """``tiny`` or an existing directory (an HF checkpoint)."""
    if text != "tiny" and not Path(text).expanduser().is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a directory (an HF checkpoint, or tiny)")
    return text


def http_url(text: str) -> str:
    """An ``http(s)://host[:port]`` URL (a server)."""
    url = urllib.parse.urlsplit(text)
    try:
        port_ok = url.port is None or url.port > 0
    except ValueError:
        port_ok = False
    if url.scheme not in ("http", "https") or not url.hostname or not port_ok:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s)://host:port URL")
    return text.rstrip("/")
