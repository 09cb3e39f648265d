"""Remote sandbox load test: many concurrent owners through AgentEnv against the fake service.

Usage:
  .venv/bin/python benchmarks/sandbox_load.py [--groups 17] [--owners 16] [--turns 3]
      [--max-connections 64] [--creations-per-s 200] [--boot-delay 0.2] [--think 0.05]
      [--no-fork] [--throttle 0]

Starts ``FakeSandboxService`` (HTTPS on 127.0.0.1, throw-away CA) in this process, runs
``groups`` prompt groups of ``owners`` owners at once through ``AgentEnv`` + ``RemoteBackend``
(each owner types its word in ``turns - 1`` steps, then answers DONE; the agent "thinks" for
``think`` seconds per turn), closes the backend and reports: wall time, owners succeeded,
requests, peak concurrently open TLS connections seen by the service (the client's
``max_connections`` must bound it) and sandboxes left in the service (must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import secrets
import tempfile
import time
from typing import Any

from osworld_jax.env.agent_env import AgentEnv, AgentEnvConfig
from osworld_jax.env.remote import RemoteBackend, RemoteBackendConfig
from osworld_jax.testing.memory import word_task
from osworld_jax.testing.sandbox_service import FakeFaults, FakeSandboxService, make_test_pki

TOKEN_ENV = "OSWORLD_JAX_LOAD_SANDBOX_TOKEN"


@dataclasses.dataclass(frozen=True)
class LoadReport:
    owners: int
    succeeded: int
    failed: int
    correct: int
    wall_s: float
    peak_connections: int
    max_connections: int
    connections_total: int
    lifecycle_requests: int
    proxy_requests: int
    sandboxes_created: int
    leaked: int
    backend_inventory_after: int
    metrics: dict[str, Any]

    def table(self) -> str:
        rows = [
            ("owners (groups x owners)", self.owners),
            ("succeeded / failed", f"{self.succeeded} / {self.failed}"),
            ("reward 1", self.correct),
            ("wall time [s]", f"{self.wall_s:.2f}"),
            ("peak open connections (service)", self.peak_connections),
            ("client max_connections", self.max_connections),
            ("TLS connections opened", self.connections_total),
            ("lifecycle requests", self.lifecycle_requests),
            ("in-VM requests", self.proxy_requests),
            ("sandboxes created", self.sandboxes_created),
            (
                "forks by fork / by snapshot",
                "{} / {}".format(
                    self.metrics["sandbox/forks_by_fork"], self.metrics["sandbox/forks_by_snapshot"]
                ),
            ),
            ("leaked sandboxes", self.leaked),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


class _Typist:
    """Types ``word`` in ``turns - 1`` chunks, then DONE; thinks ``think_s`` per turn."""

    def __init__(self, word: str, turns: int, think_s: float) -> None:
        k = max(1, turns - 1)
        size = -(-len(word) // k)
        self.replies = [
            f"```python\npyautogui.typewrite({word[i : i + size]!r})\n```"
            for i in range(0, len(word), size)
        ]
        self.think_s = think_s

    async def act(self, obs: Any) -> str:
        if self.think_s:
            await asyncio.sleep(self.think_s)
        return self.replies.pop(0) if self.replies else "DONE"


async def run_load(
    *,
    groups: int = 17,
    owners: int = 16,
    turns: int = 3,
    max_connections: int = 64,
    creations_per_s: float = 200.0,
    creation_burst: int = 32,
    boot_delay_s: float = 0.2,
    think_s: float = 0.05,
    use_fork: str = "auto",
    faults: FakeFaults | None = None,
    pki_dir: str | None = None,
) -> LoadReport:
    """Runs the load (see the module docstring) and returns its report."""
    token = "load-" + secrets.token_hex(16)
    os.environ[TOKEN_ENV] = token
    with tempfile.TemporaryDirectory(prefix="sandbox-load-") as tmp:
        pki = make_test_pki(pki_dir or tmp)
        faults = faults if faults is not None else FakeFaults()
        faults.boot_delay_s = boot_delay_s
        async with FakeSandboxService(token=token, pki=pki, faults=faults) as svc:
            cfg = RemoteBackendConfig(
                base_url=svc.base_url,
                ca_bundle=str(pki.ca_path),
                token_env=TOKEN_ENV,
                max_connections=max_connections,
                max_creations_per_s=creations_per_s,
                creation_burst=creation_burst,
                poll_interval_s=0.05,
                boot_timeout_s=60.0,
                settle_s=0.0,
                use_fork=use_fork,
                backoff_initial_s=0.05,
                backoff_max_s=2.0,
            )
            backend = RemoteBackend(cfg)
            env = AgentEnv(
                backend,
                AgentEnvConfig(max_turns=turns + 1, eval_retry_delay_s=0.1),
            )
            words = [f"word{g:02d}" for g in range(groups)]
            t0 = time.perf_counter()
            try:
                results = await asyncio.gather(
                    *(
                        env.run_group(
                            word_task(w), range(owners), lambda o, w=w: _Typist(w, turns, think_s)
                        )
                        for w in words
                    ),
                    return_exceptions=True,
                )
            finally:
                await backend.aclose()
            wall = time.perf_counter() - t0
            flat = [r for g in results if isinstance(g, list) for r in g]
            errors = [g for g in results if isinstance(g, BaseException)]
            if errors:
                raise errors[0]
            st = svc.stats
            return LoadReport(
                owners=groups * owners,
                succeeded=sum(not r.failed for r in flat),
                failed=sum(r.failed for r in flat),
                correct=sum(r.reward == 1.0 for r in flat),
                wall_s=wall,
                peak_connections=st.peak_connections,
                max_connections=max_connections,
                connections_total=st.connections_total,
                lifecycle_requests=st.requests,
                proxy_requests=st.proxy_requests,
                sandboxes_created=st.created,
                leaked=len(svc.live_ids()),
                backend_inventory_after=len(backend.inventory()),
                metrics=backend.metrics.as_dict(),
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=17)
    p.add_argument("--owners", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-connections", type=int, default=64)
    p.add_argument("--creations-per-s", type=float, default=200.0)
    p.add_argument("--boot-delay", type=float, default=0.2)
    p.add_argument("--think", type=float, default=0.05)
    p.add_argument("--no-fork", action="store_true", help="service without /fork (snapshots)")
    p.add_argument("--throttle", type=int, default=0, help="429 the first N lifecycle requests")
    args = p.parse_args()
    faults = FakeFaults(fork_supported=not args.no_fork, throttle=args.throttle, retry_after_s=0.1)
    report = asyncio.run(
        run_load(
            groups=args.groups,
            owners=args.owners,
            turns=args.turns,
            max_connections=args.max_connections,
            creations_per_s=args.creations_per_s,
            boot_delay_s=args.boot_delay,
            think_s=args.think,
            faults=faults,
        )
    )
    print(report.table())


if __name__ == "__main__":
    main()
