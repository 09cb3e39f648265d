"""The embedded engine's decode rate per ``--num-continuous-decode-steps`` (n steps a call).

Each decode call pays a dispatch, the sampling arrays sent, the tokens copied back and the
engine's Python pass over its slots; n steps a call pay them once per n tokens of every running
request. That matters where they outweigh the device's step (the 2-layer RL recipe's owners
generated ~30% faster at n = 8 on an H100), little where the step is the device's (bench-vl's
8 layers: ~10%, benchmarks/NOTES.md "Sixth session").

    .venv/bin/python benchmarks/decode_steps.py [--steps 1,2,4,8,16] [--concurrency 1,8]
        [--tokens 256] [--ckpt-dir DIR]

Prints, per n and concurrency, the greedy decode rate (tokens of all requests per second,
best of ``--repeats``) and the device calls made. Default model: a tiny random checkpoint
(`osworld_jax.model.tiny`) in float32; ``--ckpt-dir`` serves another (bfloat16 on a GPU).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    """Runs the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="1,2,4,8,16", help="decode steps a call, comma-separated")
    ap.add_argument("--concurrency", default="1,8", help="requests at once, comma-separated")
    ap.add_argument("--tokens", type=int, default=256, help="new tokens per request")
    ap.add_argument(
        "--prompt-len", type=int, default=20, help="prompt tokens (the decode attention window)"
    )
    ap.add_argument("--repeats", type=int, default=3, help="best of this many rounds")
    ap.add_argument("--ckpt-dir", default=None, help="an HF checkpoint (default: tiny)")
    ap.add_argument("--decode-expert-backend", default=None, help="e.g. dense (default: auto)")
    a = ap.parse_args()

    import jax

    from osworld_jax.model.tiny import make_tiny_checkpoint
    from osworld_jax.server.engine import Engine, EngineConfig

    ckpt = a.ckpt_dir or make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", seed=0)
    gpu = jax.default_backend() == "gpu"
    conc = [int(c) for c in a.concurrency.split(",")]
    backend = a.decode_expert_backend or "auto"
    print(f"device: {jax.devices()[0].device_kind}; {a.prompt_len}-token prompts,", end=" ")
    print(f"{a.tokens} greedy tokens per request;")
    print(f"decode expert backend {backend}")
    print("| steps a call | concurrency | tok/s | ms per step (all decoding) | device calls |")
    print("|---|---|---|---|---|")
    for n in (int(s) for s in a.steps.split(",")):
        cfg = EngineConfig(
            model_path=str(ckpt),
            max_running_requests=max(conc),
            context_length=max(512, 2 * (a.tokens + a.prompt_len)),
            min_decode_batch=max(conc),  # one batch bucket: the same program at every C
            dtype="bfloat16" if gpu else "float32",
            num_continuous_decode_steps=n,
            decode_expert_backend=a.decode_expert_backend,
        )
        eng = Engine(cfg).start()
        try:
            for c in conc:

                def round_(c: int = c, eng: Engine = eng) -> tuple[float, float]:
                    """(round s, decode-only s: from the last request's first token on)."""
                    done = [concurrent.futures.Future[None]() for _ in range(c)]
                    firsts: list[float] = []

                    def notify(r, fin, f) -> None:
                        if len(r.output_ids) == 1:
                            firsts.append(time.perf_counter())
                        if fin:
                            f.set_result(None)

                    for k in range(c):
                        req = eng.make_request(
                            rid=None,
                            input_ids=[(3 + 20 * k + j) % 1000 + 3 for j in range(a.prompt_len)],
                            sampling={
                                "max_new_tokens": a.tokens,
                                "temperature": 0.0,
                                "ignore_eos": True,
                            },
                        )
                        req.notify = lambda r, fin, f=done[k]: notify(r, fin, f)
                        eng.submit(req)
                    t0 = time.perf_counter()
                    for f in done:
                        f.result()
                    t1 = time.perf_counter()
                    return t1 - t0, t1 - max(firsts)

                round_()  # compiles
                calls0 = eng.num_decode_steps
                best, dec = min(round_() for _ in range(a.repeats))
                calls = (eng.num_decode_steps - calls0) // (n * a.repeats)
                rate = c * a.tokens / best
                step = 1e3 * dec / max(1, a.tokens - 1)
                print(f"| {n} | {c} | {rate:.0f} | {step:.2f} | {calls} |")
        finally:
            eng.shutdown()


if __name__ == "__main__":
    main()
