"""Asyncio client of SGLang's native HTTP API, over one or many servers.

One `SGLangClient` is shared by every owner of a rollout. It balances requests over the healthy
servers, retries connection errors / timeouts / 5xx with exponential backoff, validates every reply
(`osworld_jax.rollout.wire.parse_reply`), resubmits aborted requests (a pause during a refit) with
their partial output appended, and runs the canonical refit sequence on every server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import random
import uuid
from collections.abc import Callable, Collection, Sequence
from typing import Any

import aiohttp

from osworld_jax.contract.errors import (
    AbortBudgetExceeded,
    RefitError,
    ReplyValidationError,
    RequestRejected,
    RolloutError,
    ServerUnavailable,
)
from osworld_jax.contract.refit import (
    DiskWeights,
    StreamedWeights,
    UpdateStep,
    Weights,
    update_problem,
)
from osworld_jax.rollout.config import RolloutConfig, SamplingParams
from osworld_jax.rollout.state import ServerState
from osworld_jax.rollout.wire import Generation, Reply, parse_reply, stitch

log = logging.getLogger(__name__)

_RETRIABLE = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)


class _Retriable(Exception):
    """Internal: a failure worth retrying on another attempt (5xx, connection, timeout)."""


class SGLangClient:
    """Asyncio client of one or many SGLang-compatible servers.

    Args:
      urls: server base URLs; None uses ``config.urls``.
      config: client settings (`RolloutConfig`).
      detokenize: ``detokenize(ids, skip_special_tokens=...) -> str``, e.g.
        ``AgentTokenizer.decode``; gives `Generation.text` when the servers send none (SGLang
        started with ``--skip-tokenizer-init``). Without it such a text is "".
      media_token_ids: the model's media placeholder ids (``<|image_pad|>``, ...): an aborted
        request whose partial output holds one is not resubmitted (see `generate`).

    Use as ``async with SGLangClient(urls, config) as client:`` or call `aclose` at the end.
    """

    def __init__(
        self,
        urls: Sequence[str] | str | None,
        config: RolloutConfig,
        *,
        detokenize: Callable[..., str] | None = None,
        media_token_ids: Collection[int] = (),
    ) -> None:
        if urls is not None:
            urls = (urls,) if isinstance(urls, str) else tuple(urls)
            config = dataclasses.replace(config, urls=urls)
        self.config = config
        self.detokenize = detokenize
        self.media_token_ids = frozenset(int(t) for t in media_token_ids)
        self.servers = [ServerState(url=u) for u in config.urls]
        self._rr = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._started: asyncio.Lock | None = None
        self._probed = False
        self._expected_version: str | None = None
        self._refit_lock: asyncio.Lock | None = None
        self._not_refitting: asyncio.Event | None = None
        self._server_ready: asyncio.Condition | None = None

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> SGLangClient:
        await self._ensure_started()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _ensure_started(self) -> None:
        if self._started is None:
            self._started = asyncio.Lock()
            self._refit_lock = asyncio.Lock()
            self._not_refitting = asyncio.Event()
            self._not_refitting.set()
            self._server_ready = asyncio.Condition()
        async with self._started:
            if self._session is None:
                self._session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(
                        limit=self.config.max_connections, limit_per_host=0
                    ),
                    timeout=aiohttp.ClientTimeout(total=self.config.control_timeout_s),
                )
            if not self._probed:
                self._probed = True
                await self.health()
                self._health_task = asyncio.create_task(self._health_loop())

    async def aclose(self) -> None:
        """Stops the health loop and closes the connection pool."""
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except asyncio.CancelledError:
                pass
            self._health_task = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._probed = False
        self._started = None  # asyncio primitives bind to a loop: a reopened client makes new ones

    @property
    def weight_version(self) -> str | None:
        """The weight version every reply must carry (set by `refit`, or learned at start)."""
        return self._expected_version

    @property
    def active_urls(self) -> list[str]:
        """Servers currently in rotation and healthy."""
        return [s.url for s in self.servers if s.usable]

    # ------------------------------------------------------------------ health

    async def _probe(self, s: ServerState) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(s.url + "/health") as r:
                if r.status != 200:
                    raise _Retriable(f"/health answered {r.status}")
            async with self._session.get(s.url + "/model_info") as r:
                if r.status != 200:
                    raise _Retriable(f"/model_info answered {r.status}")
                info = await r.json(content_type=None)
            version = info.get("weight_version")
            s.weight_version = None if version is None else str(version)
        except (*_RETRIABLE, _Retriable, ValueError, AttributeError) as e:
            s.healthy, s.last_error = False, f"health: {type(e).__name__}: {e}"
            return False
        if self._expected_version is None and s.in_rotation:
            self._expected_version = s.weight_version
        if self._expected_version is not None and s.weight_version != self._expected_version:
            # Old or foreign weights: never route to it until a refit brings it in line.
            s.healthy = False
            s.last_error = f"serves weight_version {s.weight_version!r}, expected " + repr(
                self._expected_version
            )
            return False
        s.healthy = True
        return True

    async def health(self) -> dict[str, bool]:
        """Probes ``/health`` and ``/model_info`` of every server now; returns url -> usable."""
        if self._session is None:
            await self._ensure_started()
        await asyncio.gather(*(self._probe(s) for s in self.servers))
        if self._server_ready is not None and any(s.usable for s in self.servers):
            async with self._server_ready:
                self._server_ready.notify_all()
        return {s.url: s.usable for s in self.servers}

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            assert self._not_refitting is not None
            await self._not_refitting.wait()
            try:
                await self.health()
            except Exception:  # the loop must survive anything a probe throws
                log.exception("health probe failed")

    async def _pick(self, rid: str) -> ServerState:
        assert self._server_ready is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.unavailable_wait_s
        while True:
            usable = [s for s in self.servers if s.usable]
            if usable:
                if self.config.load_balancer == "round_robin":
                    return usable[next(self._rr) % len(usable)]
                start = next(self._rr)
                n = len(usable)
                # fewest outstanding; ties rotate so equal servers share load
                return min((usable[(start + i) % n] for i in range(n)), key=lambda s: s.outstanding)
            left = deadline - loop.time()
            if left <= 0:
                errors = "; ".join(f"{s.url}: {s.last_error}" for s in self.servers)
                raise ServerUnavailable(f"request {rid!r}: no healthy server ({errors})")
            async with self._server_ready:
                # asyncio.timeout, not wait_for (which can swallow a cancellation on 3.11)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(left, self.config.health_check_interval_s)):
                        await self._server_ready.wait()
            if not any(s.usable for s in self.servers):
                await self.health()

    # ------------------------------------------------------------------ generate

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        rid: str | None = None,
        routed_experts_start_len: int = 0,
        image_data: Sequence[str] | None = None,
        media_token_ids: Collection[int] | None = None,
    ) -> Generation:
        """Generates one turn for ``input_ids``; returns the validated, stitched `Generation`.

        ``image_data`` (a Qwen3-VL model) is sent as SGLang's ``image_data``: one string per
        image (base64 PNG/JPEG, a ``data:`` URL, or a file path the server can read), filling
        the prompt's image placeholders in order (each ``<|vision_start|><|image_pad|>
        <|vision_end|>``, expanded by the server, or already expanded to the processor's count
        with `osworld_jax.server.images.expand_image_tokens`). ``prompt_tokens`` and the
        route rows then count the expanded prompt; send expanded prompts for token-exact
        training (every position the trainer sees is then one the caller sent).

        An ``abort`` finish (a pause during a refit, or ``/abort_request``) is resubmitted with
        the partial output appended to the prompt and ``max_new_tokens`` (and
        ``min_new_tokens``) reduced, up to ``config.max_abort_resubmits`` times; the parts'
        logprobs and routes are stitched (see `osworld_jax.rollout.wire.stitch`). Limits of a
        resubmission: the server checks stop strings on each part's own output, so a stop
        string straddling the abort point is not matched; ``sampling_seed`` restarts the
        server's random stream for the new part. An aborted part whose output holds one of
        ``media_token_ids`` (default: the client's; a generated ``<|image_pad|>``,
        ``<|video_pad|>``, ...) is not resubmitted: in a prompt the server (SGLang's processor
        as ours) would read it as a media placeholder without its media and refuse it. The
        turn ends there with ``finish_reason = {"type": "stop", "matched": <that token>,
        "message": ...}``; the agent trains a reply only up to its first generated media token
        anyway.

        Raises:
          ReplyValidationError: a reply broke the contract (names the rid).
          AbortBudgetExceeded: too many aborts; the owner is failed, never truncated.
          ServerUnavailable: retries exhausted on connection errors / timeouts / 5xx.
          RequestRejected: a 4xx answer (the request is wrong; not retried).
        """
        await self._ensure_started()
        sampling = self.config.sampling if sampling is None else sampling
        media_ids = self.media_token_ids if media_token_ids is None else media_token_ids
        rid = rid or uuid.uuid4().hex
        prompt = [int(t) for t in input_ids]
        if not prompt:
            raise ValueError(f"request {rid!r}: empty prompt")
        want_routes = self.config.return_routed_experts
        images = [str(x) for x in image_data] if image_data else None
        # Placeholders expand on the server: the served prompt may be longer than ours.
        upper = len(prompt) if images is None else None
        if want_routes and (
            routed_experts_start_len < 0 or (upper is not None and routed_experts_start_len > upper)
        ):
            raise ValueError(
                f"request {rid!r}: routed_experts_start_len={routed_experts_start_len} outside "
                f"[0, {len(prompt)}]"
            )
        served_prompt = None if images is not None else len(prompt)  # learnt from a reply
        parts: list[Reply] = []
        produced = 0
        aborts = 0
        start = routed_experts_start_len
        part_prompt = prompt
        while True:
            assert self._not_refitting is not None
            await self._not_refitting.wait()
            part_sampling = sampling.replace(
                max_new_tokens=sampling.max_new_tokens - produced,
                min_new_tokens=max(0, sampling.min_new_tokens - produced),
            )
            wire_rid = rid if not aborts else f"{rid}.resubmit{aborts}"
            payload: dict[str, Any] = {
                "input_ids": part_prompt,
                "sampling_params": part_sampling.to_wire(),
                "return_logprob": self.config.return_logprob,
                "logprob_start_len": -1,
                "return_routed_experts": want_routes,
                "routed_experts_start_len": start,
                "rid": wire_rid,
                "stream": False,
            }
            if images is not None:
                payload["image_data"] = images
            expect = None if served_prompt is None else served_prompt + produced
            reply = await self._post_generate(
                payload, wire_rid, expect, start if want_routes else None
            )
            if served_prompt is None:
                if reply.prompt_tokens < len(part_prompt):
                    raise ReplyValidationError(
                        wire_rid,
                        f"prompt_tokens={reply.prompt_tokens} but the prompt had "
                        f"{len(part_prompt)} tokens before its images were expanded",
                    )
                served_prompt = reply.prompt_tokens - produced
            aborted = reply.finish_reason["type"] == "abort"
            if not (aborted and reply.completion_tokens == 0):  # an empty abort adds nothing
                parts.append(reply)
            produced += reply.completion_tokens
            if not aborted:
                break
            if produced >= sampling.max_new_tokens and parts:
                # Aborted exactly at the length limit: the turn is complete, not truncated.
                parts[-1] = dataclasses.replace(
                    parts[-1], finish_reason={"type": "length", "length": produced}
                )
                break
            media = [t for t in reply.output_ids if t in media_ids]
            if media:
                parts[-1] = dataclasses.replace(
                    parts[-1],
                    finish_reason={
                        "type": "stop",
                        "matched": media[0],
                        "message": "aborted after a generated media token: not resubmitted",
                    },
                )
                break
            aborts += 1
            if aborts > self.config.max_abort_resubmits:
                raise AbortBudgetExceeded(
                    rid,
                    f"aborted {aborts} times ({reply.finish_reason.get('message', '')!s}); "
                    f"budget is {self.config.max_abort_resubmits} resubmissions",
                )
            log.info("request %s aborted after %d tokens; resubmitting", rid, produced)
            if reply.completion_tokens:
                part_prompt = part_prompt + reply.output_ids
                start = max(routed_experts_start_len, served_prompt + produced - 1)
        assert served_prompt is not None
        gen = stitch(
            parts,
            rid=rid,
            prompt_tokens=served_prompt,
            routed_experts_start_len=routed_experts_start_len,
            num_resubmits=aborts,
        )
        if self.detokenize is not None and all(p.text_missing for p in parts):
            gen = dataclasses.replace(gen, text=self._text_of(gen, sampling))
        return gen

    def _text_of(self, gen: Generation, sampling: SamplingParams) -> str:
        """The text SGLang would have sent (matched stop token trimmed unless no_stop_trim)."""
        assert self.detokenize is not None
        ids = list(gen.output_ids)
        matched = gen.finish_reason.get("matched")
        if isinstance(matched, int) and not sampling.no_stop_trim and ids and ids[-1] == matched:
            ids = ids[:-1]
        return self.detokenize(ids, skip_special_tokens=sampling.skip_special_tokens)

    async def _post_generate(
        self, payload: dict[str, Any], rid: str, prompt_len: int | None, start: int | None
    ) -> Reply:
        cfg = self.config
        timeout = aiohttp.ClientTimeout(
            total=cfg.request_timeout_s, sock_connect=cfg.connect_timeout_s
        )
        for attempt in itertools.count():
            if attempt:
                payload = {**payload, "rid": f"{rid}.retry{attempt}"}
            expected_before = self._expected_version
            server = await self._pick(rid)
            if self._session is None or self._session.closed:
                raise ServerUnavailable(f"request {rid!r}: the client was closed")
            server.outstanding += 1
            server.dispatched += 1
            try:
                async with self._session.post(
                    server.url + "/generate", json=payload, timeout=timeout
                ) as resp:
                    if resp.status >= 500:
                        raise _Retriable(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                    if resp.status >= 400:
                        raise RequestRejected(rid, resp.status, (await resp.text())[:500])
                    try:
                        body = await resp.json(content_type=None)
                    except ValueError as e:
                        raise ReplyValidationError(rid, f"reply is not JSON: {e}") from None
            except (*_RETRIABLE, _Retriable) as e:
                error = f"{type(e).__name__}: {e}"
                server.last_error = error
                server.failed += 1
                if isinstance(e, aiohttp.ClientConnectionError):
                    server.healthy = False  # drained until a health probe succeeds
                elif isinstance(e, asyncio.TimeoutError):
                    asyncio.create_task(self._abort_on(server, payload["rid"]))
                if attempt >= cfg.max_retries:
                    raise ServerUnavailable(
                        f"request {rid!r}: {attempt + 1} attempts failed; last on {server.url}: "
                        f"{error}"
                    ) from e
                delay = min(cfg.backoff_max_s, cfg.backoff_initial_s * 2**attempt)
                delay *= random.uniform(0.75, 1.25)
                log.warning("request %s on %s: %s; retry in %.2fs", rid, server.url, error, delay)
                await asyncio.sleep(delay)
                continue
            finally:
                server.outstanding -= 1
            reply = parse_reply(
                body,
                rid=rid,
                prompt_len=prompt_len,
                return_logprob=cfg.return_logprob,
                routed_experts_start_len=start,
                num_layers=cfg.num_layers,
                top_k=cfg.num_experts_per_tok,
            )
            accepted = {v for v in (expected_before, self._expected_version) if v is not None}
            if accepted and reply.weight_version not in accepted:
                raise ReplyValidationError(
                    rid,
                    f"{server.url} answered with weight_version {reply.weight_version!r}, "
                    f"expected {sorted(accepted)}",
                )
            return reply
        raise AssertionError("unreachable")

    async def _abort_on(self, server: ServerState, rid: str) -> None:
        """Best effort: stop a timed-out request from occupying the server."""
        assert self._session is not None
        try:
            async with self._session.post(server.url + "/abort_request", json={"rid": rid}):
                pass
        except (*_RETRIABLE, aiohttp.ClientError):
            pass

    # ------------------------------------------------------------------ refit

    async def _control(
        self, s: ServerState, path: str, body: dict[str, Any] | None, timeout: float
    ) -> tuple[int, str]:
        assert self._session is not None
        async with self._session.post(
            s.url + path,
            json=body if body is not None else {},
            timeout=aiohttp.ClientTimeout(
                total=timeout, sock_connect=self.config.connect_timeout_s
            ),
        ) as r:
            return r.status, await r.text()

    async def _refit_one(
        self, s: ServerState, weights: Weights | StreamedWeights, weight_version: str
    ) -> None:
        cfg = self.config
        status, text = await self._control(
            s, "/pause_generation", {"mode": "abort"}, cfg.control_timeout_s
        )
        if status != 200:
            raise RolloutError(f"/pause_generation answered {status}: {text[:200]}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.flush_max_wait_s
        while True:
            status, text = await self._control(s, "/flush_cache", None, cfg.control_timeout_s)
            if status == 200:
                break
            if status != 400:
                raise RolloutError(f"/flush_cache answered {status}: {text[:200]}")
            if loop.time() > deadline:
                raise RolloutError(f"/flush_cache still busy after {cfg.flush_max_wait_s}s")
            # Busy: requests that reached the server after the pause (sent before the refit
            # began) wait in its queue. Abort them too (their clients resubmit them after the
            # refit); waiting for ten polls first held an asynchronous step's refit for 2 s.
            await self._control(s, "/pause_generation", {"mode": "abort"}, cfg.control_timeout_s)
            await asyncio.sleep(cfg.flush_poll_interval_s)
        if isinstance(weights, StreamedWeights):
            steps = weights.steps(s.url, weight_version)
            while (step := await asyncio.to_thread(next, steps, None)) is not None:
                await self._update_step(s, step, weights.expected_digest)
        else:
            for endpoint, body in weights.requests(weight_version):
                await self._update_step(
                    s, UpdateStep(endpoint=endpoint, body=body), weights.expected_digest
                )
        status, text = await self._control(s, "/continue_generation", {}, cfg.control_timeout_s)
        if status != 200:
            raise RolloutError(f"/continue_generation answered {status}: {text[:200]}")
        assert self._session is not None
        async with self._session.get(s.url + "/model_info") as r:
            info = await r.json(content_type=None)
        if info.get("weight_version") != weight_version:
            raise RolloutError(
                f"/model_info reports weight_version {info.get('weight_version')!r} after refit "
                f"to {weight_version!r}"
            )
        s.weight_version = weight_version

    async def _update_step(self, s: ServerState, step: UpdateStep, digest: str | None) -> None:
        """One update request; its ``during`` (the trainer's half of a collective) runs on a
        worker thread while the request is in flight."""  # noqa: D205, D209
        request = self._control(s, step.endpoint, step.body, self.config.refit_timeout_s)
        if step.during is None:
            status, text = await request
        else:
            (status, text), _ = await asyncio.gather(request, asyncio.to_thread(step.during))
        problem = update_problem(step, status, text, digest)
        if problem is not None:
            raise RolloutError(problem)

    async def refit(
        self, weights: Weights | StreamedWeights | str, weight_version: str
    ) -> dict[str, str | None]:
        """Moves every server to ``weights`` (a string: a ``save_hf_checkpoint`` directory).

        ``weights`` is a `DiskWeights`, `TensorWeights` or `StreamedWeights` (real SGLang's
        in-memory endpoints, bucket by bucket; `osworld_jax.contract.refit`).

        Per server: ``/pause_generation`` (abort: in-flight requests come back aborted and are
        resubmitted by `generate` after the refit) -> ``/flush_cache`` polled with a sleep (400
        = busy: what arrived after the pause is aborted too before the next poll) -> the update
        (``/update_weights_from_disk {model_path, weight_version}``, or
        ``/update_weights_from_tensor`` per bucket; a reply's weights digest must match the
        trainer's where both are known) -> ``/continue_generation`` -> ``/model_info`` must
        report ``weight_version``. New requests wait while a refit runs. A server that fails any
        step is taken out of rotation (left paused where possible, never serving old weights).

        Returns:
          url -> None on success, or the error message of the failed step.

        Raises:
          RefitError: no server completed the refit.
        """
        if isinstance(weights, str):
            weights = DiskWeights(path=weights)
        await self._ensure_started()
        assert self._refit_lock is not None and self._not_refitting is not None
        async with self._refit_lock:
            self._not_refitting.clear()
            try:
                results = await asyncio.gather(
                    *(self._refit_one(s, weights, weight_version) for s in self.servers),
                    return_exceptions=True,
                )
                report: dict[str, str | None] = {}
                for s, res in zip(self.servers, results, strict=True):
                    if isinstance(res, BaseException):
                        if isinstance(res, asyncio.CancelledError):
                            raise res
                        s.in_rotation = False
                        s.last_error = f"refit to {weight_version!r}: {type(res).__name__}: {res}"
                        report[s.url] = s.last_error
                        log.error("server %s out of rotation: %s", s.url, s.last_error)
                    else:
                        s.in_rotation, s.healthy, s.last_error = True, True, None
                        report[s.url] = None
                if all(v is not None for v in report.values()):
                    raise RefitError(
                        f"refit to {weights.describe()} ({weight_version!r}) failed on every "
                        "server: " + "; ".join(f"{u}: {e}" for u, e in report.items())
                    )
                self._expected_version = weight_version
                return report
            finally:
                self._not_refitting.set()
                assert self._server_ready is not None
                async with self._server_ready:
                    self._server_ready.notify_all()
