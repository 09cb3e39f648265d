"""The command lines' edges: --help keeps example lines whole; the server refuses a bad path."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from osworld_jax.server import serve

REPO = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"script_{name}", REPO / "scripts" / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _help(main, capsys) -> str:
    with pytest.raises(SystemExit):
        main(["--help"])
    return capsys.readouterr().out


@pytest.mark.parametrize("name", ["train.py", "evaluate.py", "freeze_band.py", "serve"])
def test_help_prints_each_example_command_on_its_own_lines(name, capsys):
    if name == "serve":
        main, doc = serve.parse_args, serve.__doc__
    else:
        module = _script(name)
        main = getattr(module, "parse_args", None) or module.main
        doc = module.__doc__
    out = _help(main, capsys)
    examples = [ln for ln in doc.splitlines() if ln.strip().startswith("python ")]
    assert examples
    for line in examples:  # whole, with its continuation backslash, not rewrapped
        assert line.rstrip() in out.splitlines(), line
        if line.rstrip().endswith("\\\\"):
            pytest.fail(f"a doubled backslash in {name}'s help: {line}")


def test_serve_refuses_a_bad_model_path_before_listening(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "osworld_jax.server.serve", "--model-path", str(tmp_path / "nope"),
         "--port", "0"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip() == (
        f"error: --model-path {tmp_path / 'nope'}: no such directory (pass a Hugging Face "
        "checkpoint directory, or 'tiny' for a random tiny model)"
    )
    assert "listening" not in r.stderr + r.stdout


def test_a_directory_without_checkpoint_files_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert serve.model_path_problem(str(tmp_path)) == (
        f"--model-path {tmp_path}: not a checkpoint directory, no *.safetensors, tokenizer.json "
        "(or pass --skip-tokenizer-init) (pass a Hugging Face checkpoint directory, or 'tiny' "
        "for a random tiny model)"
    )
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert serve.model_path_problem(str(tmp_path), skip_tokenizer_init=True) is None
