"""Prints the parameter count of HF ``config.json`` files (Qwen3-MoE or Qwen3-VL-MoE).

Usage: python scripts/param_count.py [CONFIG_OR_CHECKPOINT_DIR ...]

With no argument it counts the bundled Qwen/Qwen3-VL-30B-A3B-Instruct ``config.json``
(osworld_jax/model/assets/qwen3_vl_30b_a3b_instruct/, written from the published file; its
architecture values were checked against two independent public copies). The counts come from
the model room's parameter table (`osworld_jax.model.params.param_counts`), i.e. the arrays the
policy actually holds.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from osworld_jax.model import Qwen3MoeConfig
from osworld_jax.model.params import param_counts

BUNDLED = Path(__file__).resolve().parents[1] / (
    "osworld_jax/model/assets/qwen3_vl_30b_a3b_instruct/config.json"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", type=Path, default=[BUNDLED])
    args = parser.parse_args()
    print(f"| {'config':<48} | {'total':>9} | {'language':>9} | {'vision':>7} | {'active':>7} |")
    print(f"|{'-' * 50}|{'-' * 11}|{'-' * 11}|{'-' * 9}|{'-' * 9}|")
    for path in args.configs:
        c = param_counts(Qwen3MoeConfig.from_json(path))
        name = str(path if path.is_dir() else path.parent.name or path)[-48:]
        b = {k: v / 1e9 for k, v in c.items()}
        print(
            f"| {name:<48} | {b['total']:8.3f}B | {b['language']:8.3f}B | {b['vision']:6.3f}B "
            f"| {b['active']:6.3f}B |"
        )
    print("active = language params one token uses (K of E experts per MoE layer); the vision")
    print("tower runs once per image on top of that.")


if __name__ == "__main__":
    main()
