"""The embedded engine's decode rate beside a thread busy in Python, per GIL switch interval.

The engine's thread gives the GIL up while a decode step runs on the device and waits for it
after each one. A thread busy in pure Python beside it (HTTP handlers parsing JSON and images, a
trainer's host work, rollouts compacting contexts) keeps it until the switch interval runs out:
at Python's 5 ms, every token pays a few such waits (`EngineConfig.switch_interval_ms`).

    .venv/bin/python benchmarks/engine_gil.py [--tokens 300] [--intervals 5,2,1,0.5,0.2,0.1]

Prints, per interval, the greedy decode rate of one request alone and with one busy thread.
A tiny random checkpoint (`osworld_jax.model.tiny`), float32, on whatever device JAX has.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    """Runs the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--intervals", default="5,2,1,0.5,0.2,0.1", help="ms, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="best of this many generations")
    a = ap.parse_args()

    from osworld_jax.model.tiny import make_tiny_checkpoint
    from osworld_jax.server.engine import Engine, EngineConfig

    ckpt = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", seed=0)
    cfg = EngineConfig(
        model_path=str(ckpt),
        max_running_requests=8,
        context_length=max(512, 2 * a.tokens),
        min_decode_batch=8,
        switch_interval_ms=None,  # this script sets it
    )
    eng = Engine(cfg).start()

    def generate() -> float:
        req = eng.make_request(
            rid=None,
            input_ids=list(range(3, 23)),
            sampling={"max_new_tokens": a.tokens, "temperature": 0.0, "ignore_eos": True},
        )
        done = concurrent.futures.Future[None]()
        req.notify = lambda r, finished: done.set_result(None) if finished else None
        t0 = time.perf_counter()
        eng.submit(req)
        done.result()
        return a.tokens / (time.perf_counter() - t0)

    stop = threading.Event()

    def busy() -> None:  # pure Python: holds the GIL until the interval asks it to let go
        while not stop.is_set():
            s = 0
            for i in range(2000):
                s += i * i

    generate()  # compiles
    print("| switch interval ms | alone tok/s | beside a busy thread tok/s |")
    print("|---|---|---|")
    try:
        for ms in (float(x) for x in a.intervals.split(",")):
            sys.setswitchinterval(ms / 1e3)
            alone = max(generate() for _ in range(a.repeats))
            stop.clear()
            thread = threading.Thread(target=busy, daemon=True)
            thread.start()
            beside = max(generate() for _ in range(a.repeats))
            stop.set()
            thread.join()
            print(f"| {ms:g} | {alone:.0f} | {beside:.0f} |", flush=True)
    finally:
        eng.shutdown()


if __name__ == "__main__":
    main()
