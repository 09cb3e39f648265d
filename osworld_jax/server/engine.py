"""The embedded server's engine: continuous batching over a fixed number of KV-cache slots.

A single engine thread owns the `ModelRunner`. Each iteration it runs queued commands (new
requests, aborts, pause/continue, weight updates), admits waiting requests into free slots
(one bucketed prefill each, which also samples the first token), then runs one batched decode
step over every live slot. HTTP handlers talk to it only through `Engine` methods, which post
commands to the thread and resolve futures; request progress comes back through each request's
``notify`` callback (called on the engine thread).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from osworld_jax.contract.errors import EngineError
from osworld_jax.server.image_memory import ProcessedImageCache
from osworld_jax.server.memory import check_fits, engine_layout
from osworld_jax.server.model_files import eos_ids, load_tokenizer
from osworld_jax.server.prefix_cache import PrefixCache, prefix_key
from osworld_jax.server.refit_check import (
    check_checkpoint_files,
    checkpoint_signature,
)
from osworld_jax.server.requests import TOP_K_ALL, EngineConfig, GenRequest, build_request, num_top
from osworld_jax.server.runner import MAX_TOP_LOGPROBS, ModelRunner
from osworld_jax.server.sampling import MAX_BANNED, SlotSampling
from osworld_jax.server.weights import EngineWeights

__all__ = ["Engine", "EngineConfig", "GenRequest"]

log = logging.getLogger(__name__)


class Engine(EngineWeights):
    """Continuous-batching generation over `ModelRunner` (see module docstring).

    Args:
      config: `EngineConfig`.
      tokenizer: a ``tokenizers.Tokenizer`` (default: ``model_path/tokenizer.json``; none with
        ``config.skip_tokenizer_init``).

    Attributes:
      tokenizer: the tokenizer, or None (``skip_tokenizer_init``).
      processor: the `ImageProcessor` of a Qwen3-VL checkpoint (its
        ``preprocessor_config.json``), None for a text model.
      max_token_chars: characters of the longest vocabulary entry (a text longer than
        ``context_length * max_token_chars`` cannot fit the context).
    """

    def __init__(self, config: EngineConfig, tokenizer: Any = None) -> None:
        from osworld_jax.model import Qwen3MoeConfig

        self.config = config
        path = Path(config.model_path)
        check_checkpoint_files(path)  # regular files of bounded size only (no FIFO, no device)
        model_cfg = Qwen3MoeConfig.from_json(path / "config.json")
        layout = engine_layout(model_cfg, config)
        self.context_length = layout.context_length
        check_fits(model_cfg, layout, config.dtype, config.memory_budget_bytes)  # before loading
        self.runner = ModelRunner(
            path,
            num_slots=layout.slots,
            slot_len=layout.slot_len,
            dtype=config.dtype,
            expert_backend=config.expert_backend,
            min_bucket=config.min_bucket,
            min_decode_batch=config.min_decode_batch,
            max_prefill_batch=config.max_prefill_batch,
            mm_attention=config.mm_attention_backend,
            scan_layers=config.scan_layers,
            embedding_cache_bytes=config.mm_embedding_cache_mb << 20,
            decode_steps=config.num_continuous_decode_steps,
            extra_length_buckets=config.extra_length_buckets,
            decode_expert_backend=config.decode_expert_backend,
        )
        self.model_config = self.runner.config
        self.model_path = str(path)
        self.signature = checkpoint_signature(path)  # what a refit may not change
        self.weight_version = config.weight_version
        if config.skip_tokenizer_init:
            self.tokenizer = None
        else:
            self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path)
        self.max_token_chars = (
            max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)), default=1)
            if self.tokenizer is not None
            else 1
        )
        self.eos_ids = eos_ids(path, self.model_config)
        self.processor = self.runner.processor
        self.image_cache = ProcessedImageCache(config.vlm_cache_size_mb << 20)
        self.vocab_size = self.model_config.vocab_size
        self._rng = np.random.default_rng(config.seed)
        n = self.runner.num_slots
        self.prefix = PrefixCache(n, enabled=config.enable_prefix_cache)
        self.slots: list[GenRequest | None] = [None] * n
        self.waiting: collections.deque[GenRequest] = collections.deque()
        self.paused = False
        self._cmds: queue.Queue[Callable[[], None]] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()
        self.num_decode_steps = 0
        # engine-thread seconds in prefills (images' tower runs included) and decode steps; each
        # ends reading its tokens back, so these are the device's time plus the host's
        self.prefill_seconds = self.decode_seconds = 0.0
        self._beat_at, self._working = time.monotonic(), False  # last progress; in a step?
        self.num_generated_tokens = 0
        # per-slot sampling state (host arrays, sliced to the decode bucket)
        self._temp = np.ones(n, np.float32)
        self._top_p = np.ones(n, np.float32)
        self._top_k = np.full(n, TOP_K_ALL, np.int32)
        self._min_p = np.zeros(n, np.float32)
        self._lp_temp = np.ones(n, np.float32)
        self._keys = np.zeros((n, 2), np.uint32)

    # ----------------------------------------------------------------- thread

    def start(self) -> Engine:
        """Starts the engine thread and warms it up (compiles the smallest buckets)."""
        interval = self.config.switch_interval_ms
        if interval is not None and interval / 1e3 < sys.getswitchinterval():
            sys.setswitchinterval(interval / 1e3)  # the GIL back soon after each device step
        self._thread = threading.Thread(target=self._loop, name="osworld-jax-engine", daemon=True)
        self._thread.start()
        done = concurrent.futures.Future[GenRequest]()
        warm = self.make_request(
            rid=f"warmup-{uuid.uuid4().hex}",
            input_ids=[int(self.eos_ids[0]) if self.eos_ids else 0],
            sampling={"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True},
        )

        def notify(r: GenRequest, finished: bool) -> None:
            if finished:
                done.set_result(r)

        warm.notify = notify
        self.submit(warm)
        result = done.result()
        if result.finish is None or result.finish["type"] == "abort":
            self.shutdown()
            raise EngineError(f"warm-up generation failed: {result.finish}")
        warmup = self.config.warmup_decode_buckets
        if warmup if warmup is not None else jax.default_backend() != "cpu":
            # Every decode (batch, window, steps) bucket now, as SGLang captures its CUDA graphs
            # at start: a run never stalls on a decode compile when its batch or context grows.
            t0 = time.perf_counter()
            n = self.precompile(prefill=False)
            log.info("compiled %d decode buckets in %.1f s", n, time.perf_counter() - t0)
        self.ready.set()
        return self

    def precompile(
        self, prompt_len: int | None = None, total_len: int | None = None, prefill: bool = True
    ) -> int:
        """Compiles ahead of traffic the buckets of ``prompt_len``-token prompts.

        Covers sequences growing to ``total_len`` tokens (see `ModelRunner.precompile`; None:
        every text bucket of `ModelRunner.buckets`, only the decode ones without ``prefill``);
        runs on the engine thread and needs it idle. Returns the number of compiled calls.
        """

        def run() -> int:
            if self.waiting or any(self.slots):
                raise EngineError("precompile needs an idle engine")
            return self.runner.precompile(
                prompt_len=prompt_len, total_len=total_len, prefill=prefill
            )

        return int(self._call(run).result())

    def shutdown(self) -> None:
        """Stops the engine thread (requests in flight finish with ``abort``)."""
        if self._thread is None:
            return

        def stop() -> None:
            self._abort_matching(lambda r: True, "server shutting down")
            self._stop.set()

        self._cmds.put(stop)
        self._thread.join(timeout=30)
        self._thread = None

    @property
    def alive(self) -> bool:
        """The engine thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def _call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Runs ``fn`` on the engine thread between steps; returns a future of its result."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)

        self._cmds.put(run)
        return fut

    def stalled_s(self) -> float | None:
        """Seconds the engine thread is stuck in one command or step (past the timeout), or None."""
        stuck = time.monotonic() - self._beat_at
        if self._working and stuck > self.config.stall_timeout_s:
            return stuck
        return None

    def _beat(self, working: bool) -> None:
        self._beat_at, self._working = time.monotonic(), working

    def _loop(self) -> None:
        while not self._stop.is_set():
            busy = not self.paused and (self.waiting or any(self.slots))
            self._beat(working=False)
            try:
                cmd = self._cmds.get(block=not busy, timeout=None if busy else 0.5)
            except queue.Empty:
                cmd = None
            self._beat(working=True)
            while cmd is not None:
                cmd()
                self._beat(working=True)
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            if self._stop.is_set() or self.paused:
                continue
            try:
                self._admit()
                if any(self.slots):
                    t0 = time.perf_counter()
                    self._decode_step()
                    self.decode_seconds += time.perf_counter() - t0
            except Exception as e:  # a failing decode step cannot be pinned on one request
                log.exception("engine step failed")
                self._abort_matching(lambda r: True, f"engine error: {type(e).__name__}: {e}")
                self.prefix.clear()  # the slots' rows may be half written

    # ----------------------------------------------------------------- requests

    def make_request(
        self, *, rid: str | None, input_ids: list[int], sampling: dict[str, Any], **opts: Any
    ) -> GenRequest:
        """A `GenRequest` of validated wire values for this engine (see `build_request`)."""
        return build_request(
            rid=rid,
            input_ids=input_ids,
            sampling=sampling,
            rng=self._rng,
            context_length=self.context_length,
            return_original_logprob=self.config.return_original_logprob,
            tokenizer=self.tokenizer,
            **opts,
        )

    def submit(self, req: GenRequest) -> None:
        """Queues ``req``; progress arrives through ``req.notify``."""
        self._cmds.put(lambda: self.waiting.append(req))

    def abort(self, rid: str | None, abort_all: bool = False) -> concurrent.futures.Future[int]:
        """Aborts requests whose rid starts with ``rid`` (or all); returns how many.

        An empty ``rid`` without ``abort_all`` aborts nothing (SGLang's ``TokenizerManager.
        abort_request`` ignores it: as a prefix it would match every request).
        """
        if abort_all:
            return self._call(lambda: self._abort_matching(lambda r: True, "abort_all"))
        prefix = rid or ""
        if not prefix:
            return self._call(lambda: 0)
        return self._call(
            lambda: self._abort_matching(
                lambda r: r.rid.startswith(prefix), f"aborted by /abort_request {prefix!r}"
            )
        )

    def pause(self, mode: str) -> concurrent.futures.Future[int]:
        """Pauses generation; new requests queue until `resume`.

        Modes: ``abort``: in-flight requests return aborted with their partial output;
        ``retract``: they go back to the queue (resumed by re-prefilling prompt + output);
        ``in_place``: decoding just stops.
        """

        def run() -> int:
            self.paused = True
            if mode == "abort":
                return self._abort_matching(lambda r: True, "aborted by /pause_generation")
            if mode == "retract":
                running = [r for r in self.slots if r is not None]
                for r in running:
                    self._release(r)
                self.waiting.extendleft(reversed(running))
                return len(running)
            return 0

        return self._call(run)

    def resume(self) -> concurrent.futures.Future[None]:
        """Continues generation after a pause."""

        def run() -> None:
            self.paused = False

        return self._call(run)

    def is_idle(self) -> concurrent.futures.Future[bool]:
        """True when nothing runs or waits (``/flush_cache`` may proceed)."""
        return self._call(lambda: not self.waiting and not any(self.slots))

    def flush_cache(self) -> concurrent.futures.Future[bool]:
        """Forgets the kept prefixes and image embeddings if idle; returns whether it did."""

        def run() -> bool:
            if self.waiting or any(self.slots):
                return False
            self.prefix.clear()
            if self.runner.embeddings is not None:
                self.runner.embeddings.clear()
            return True

        return self._call(run)

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Runs ``fn`` on the engine thread between steps (e.g. to read a consistent state)."""
        return self._call(fn)

    def cancel(self, reqs: list[GenRequest], message: str) -> concurrent.futures.Future[int]:
        """Aborts exactly ``reqs`` (not other requests sharing an rid prefix); returns how many."""
        ids = {id(r) for r in reqs}
        return self._call(lambda: self._abort_matching(lambda r: id(r) in ids, message))

    # ----------------------------------------------------------------- scheduling

    def _abort_matching(self, pred: Callable[[GenRequest], bool], message: str) -> int:
        victims = [r for r in self.slots if r is not None and pred(r)]
        victims += [r for r in self.waiting if pred(r)]
        self.waiting = collections.deque(r for r in self.waiting if not pred(r))
        for r in victims:
            self._finish(r, {"type": "abort", "message": message})
        return len(victims)

    def _release(self, req: GenRequest) -> None:
        if req.slot is not None:
            if req.num_route_rows:  # prefilled: rows [0, fed tokens) hold its KV; keep them
                c = self.model_config
                empty = np.zeros((0, c.num_hidden_layers, c.num_experts_per_tok), np.int32)
                routes = np.concatenate([empty, *req.routes], axis=0)
                self.prefix.store(req.slot, self._key(req)[: req.num_route_rows], routes)
            self.slots[req.slot] = None
            req.slot = None

    def _finish(self, req: GenRequest, reason: dict[str, Any]) -> None:
        self._release(req)
        req.finish = reason
        self._notify(req, True)

    @staticmethod
    def _notify(req: GenRequest, done: bool) -> None:
        try:
            req.notify(req, done)
        except Exception:  # a broken listener must not stall the engine or its other requests
            log.exception("notify of request %s failed", req.rid)

    def _banned(self, req: GenRequest) -> np.ndarray:
        row = np.full(MAX_BANNED, self.vocab_size, np.int32)
        if len(req.output_ids) < req.min_new_tokens:
            ids = sorted(req.stop_token_ids | (set() if req.ignore_eos else set(self.eos_ids)))
            row[: len(ids)] = ids[:MAX_BANNED]
        return row

    def _sampling(self, idx: list[int] | slice, reqs: list[GenRequest | None]) -> SlotSampling:
        banned = np.stack(
            [
                self._banned(r) if r is not None else np.full(MAX_BANNED, self.vocab_size)
                for r in reqs
            ]
        )
        step = np.array([len(r.output_ids) if r is not None else 0 for r in reqs], np.int32)
        return SlotSampling(
            temperature=self._temp[idx],
            top_p=self._top_p[idx],
            top_k=self._top_k[idx],
            min_p=self._min_p[idx],
            banned=banned,
            keys=self._keys[idx],
            step=step,
            logprob_temperature=self._lp_temp[idx],
        )

    def _admit(self) -> None:
        # At most --max-prefill-tokens new tokens (the first request whatever its length) are
        # prefilled before the next decode step: running requests keep decoding while a burst
        # of long prompts (screenshots) is admitted over several iterations.
        admitted: list[GenRequest] = []
        budget = self.config.max_prefill_tokens
        while self.waiting and None in self.slots and (budget > 0 or not admitted):
            req = self.waiting.popleft()
            try:
                self._place(req)
            except Exception as e:  # a value of this request: it alone fails
                self._fail([req], e)
                continue
            admitted.append(req)
            budget -= len(req.input_ids) + len(req.output_ids) - req.match
        # Same prefill shape (suffix bucket, attention window, images or not) -> one batched
        # call (at most max_prefill_batch rows).
        groups: dict[tuple[int, int, bool], list[GenRequest]] = collections.defaultdict(list)
        for req in admitted:
            seq = [req.input_ids + req.output_ids]
            bucket = self.runner.prefill_bucket(len(seq[0]) - req.match)
            window = self.runner.attention_bucket(seq, [req.match])
            groups[bucket, window, req.images is not None].append(req)
        for (bucket, _, _), group in groups.items():
            # Batch short prompts only: padding rows of long ones would waste whole prefills.
            step = self.runner.buckets.prefill_rows(bucket)
            for i in range(0, len(group), step):
                chunk = group[i : i + step]
                t0 = time.perf_counter()
                try:
                    self._prefill(chunk, step)
                except Exception as e:  # only the requests of this prefill fail
                    self._fail(chunk, e)
                self.prefill_seconds += time.perf_counter() - t0

    def _fail(self, reqs: list[GenRequest], e: Exception) -> None:
        """Aborts ``reqs`` after an error of their own (not the batch's); keeps none of its rows."""
        log.exception("requests %s failed", [r.rid for r in reqs])
        reason = {"type": "abort", "message": f"engine error: {type(e).__name__}: {e}"}
        for r in reqs:
            if r.finish is None:
                slot, r.num_route_rows = r.slot, 0  # its rows may be half written
                self._finish(r, dict(reason))
                if slot is not None:
                    self.prefix.drop(slot)

    def _place(self, req: GenRequest) -> None:
        """Puts ``req`` into a free slot.

        A slot keeping a prefix of its tokens wins when reusing it saves a prefill bucket or
        images (`PrefixCache.choose`); else an empty slot, else the oldest kept prefix's.
        """
        n = len(req.input_ids) + len(req.output_ids)
        key = self._key(req)
        limit = n - 1  # at least one token is computed: it gives the next token's logits
        if req.return_logprob and req.logprob_start_len >= 0 and req.input_logprobs is None:
            limit = min(limit, max(req.logprob_start_len - 1, 0))  # prompt logprobs computed
        full = self.runner.prefill_bucket(n)

        def worth(m: int) -> bool:
            saves_images = req.images is not None and bool((key[:m] < 0).any())
            return self.runner.prefill_bucket(n - m) < full or saves_images

        free = [i for i, r in enumerate(self.slots) if r is None]
        slot, m, routes = self.prefix.choose(free, key, limit, worth)
        self.prefix.drop(slot)
        if req.num_route_rows == 0:
            req.cached_tokens = min(m, len(req.input_ids))
        if routes is not None and req.num_route_rows < m:  # route rows of the kept tokens
            req.routes.append(routes[req.num_route_rows :])
            req.num_route_rows = m
        req.match = m
        self.slots[slot] = req
        req.slot = slot
        self._temp[slot], self._top_p[slot] = req.temperature, req.top_p
        self._top_k[slot], self._min_p[slot] = req.top_k, req.min_p
        self._lp_temp[slot], self._keys[slot] = req.logprob_temperature, req.key
        self._banned(req)  # a bad stop id fails here (this request only), not in a decode step

    def _key(self, req: GenRequest) -> np.ndarray:
        """Prefix-cache keys of ``req``'s tokens (prompt, then output ids)."""
        if req.prefix_key is None:
            image_token = getattr(self.model_config, "image_token_id", None)
            req.prefix_key = prefix_key(req.input_ids, req.images, image_token)
        if not req.output_ids:
            return req.prefix_key
        return np.concatenate([req.prefix_key, np.asarray(req.output_ids, np.int64)])

    def _prefill(self, reqs: list[GenRequest], max_rows: int) -> None:
        # A retracted request resumes from prompt + output (its last token not yet fed).
        prompts = [r.input_ids + r.output_ids for r in reqs]
        slots = [r.slot for r in reqs]
        assert all(s is not None for s in slots)
        samp = self._sampling(slots, list(reqs))  # type: ignore[arg-type]
        images = None
        if any(r.images is not None for r in reqs):
            images = [
                None if r.images is None else r.images.restore(self.processor, self.image_cache)
                for r in reqs
            ]
        results = self.runner.prefill(
            slots,  # type: ignore[arg-type]
            prompts,
            samp,
            max_rows,
            images,
            num_top(reqs),
            [r.match for r in reqs],
        )
        for req, prompt, res in zip(reqs, prompts, results, strict=True):
            wants_input = 0 <= req.logprob_start_len < len(req.input_ids)
            if req.return_logprob and wants_input and req.input_logprobs is None:
                req.input_logprobs, req.input_top = self.runner.prompt_logprobs(
                    res.hidden,
                    req.input_ids,
                    MAX_TOP_LOGPROBS if req.top_logprobs_num else 0,
                    req.match,
                    res.row,
                )
            req.routes.append(res.routes[max(0, req.num_route_rows - req.match) :])
            req.num_route_rows = len(prompt)
            req.rope_delta = res.rope_delta
            if req.images is not None:  # its KV holds them now; keep only the encoded bytes
                req.images = req.images.without_pixels()
            if req.max_new_tokens <= 0:  # prompt-only request (routes / prompt logprobs)
                self._finish(req, {"type": "length", "length": 0})
            else:
                self._append(req, res.token, res.logprob, res.top)

    def _decode_step(self) -> None:
        live = [i for i, r in enumerate(self.slots) if r is not None]
        b = self.runner.buckets.batch(max(live) + 1)
        reqs = self.slots[:b]
        tokens, positions, rope, active, ban = (np.zeros(b, np.int32) for _ in range(5))
        for i in live:
            r = reqs[i]
            assert r is not None
            tokens[i] = r.output_ids[-1]
            positions[i] = len(r.input_ids) + len(r.output_ids) - 1
            rope[i] = positions[i] + r.rope_delta
            active[i] = 1
            ban[i] = max(0, r.min_new_tokens - len(r.output_ids))
        samp = self._sampling(slice(0, b), reqs)
        # `--num-continuous-decode-steps` only while no prefill waits for this iteration's
        # admission (SGLang runs its continuous steps when no prefill batch was formed): a
        # burst of prompts is admitted between single steps, not between n-step calls.
        steps = 1 if self.waiting and None in self.slots else None
        toks, lps, routes, (top_ids, top_lps) = self.runner.decode(
            tokens, positions, active, samp, rope, num_top(reqs), ban_steps=ban, steps=steps
        )  # each [n, b, ...]: n decode steps
        self.num_decode_steps += len(toks)
        for i in live:
            r = reqs[i]
            assert r is not None
            for j in range(len(toks)):  # until the request finishes (the rest is dropped)
                r.routes.append(routes[j, i : i + 1])
                r.num_route_rows += 1
                try:
                    top = (top_ids[j, i], top_lps[j, i])
                    self._append(r, int(toks[j, i]), float(lps[j, i]), top)
                except Exception as e:  # its stop check: this request alone fails
                    self._fail([r], e)
                if self.slots[i] is not r:  # finished, failed or released
                    break

    def _append(
        self, req: GenRequest, tok: int, lp: float, top: tuple[np.ndarray, np.ndarray]
    ) -> None:
        req.output_ids.append(tok)
        req.output_logprobs.append(lp)
        if req.top_logprobs_num:
            k = req.top_logprobs_num
            req.output_top.append((np.asarray(top[0][:k]), np.asarray(top[1][:k])))
        self.num_generated_tokens += 1
        n = len(req.output_ids)
        reason: dict[str, Any] | None = None
        if tok in req.stop_token_ids or (not req.ignore_eos and tok in self.eos_ids):
            reason = {"type": "stop", "matched": tok}
        if reason is None and req.stop and self.tokenizer is not None:
            tail = self.tokenizer.decode(
                req.output_ids[-req.stop_window :], skip_special_tokens=req.skip_special_tokens
            )
            for s in req.stop:
                if s in tail:
                    reason = {"type": "stop", "matched": s}
                    break
        if reason is None and n >= req.max_new_tokens:
            reason = {"type": "length", "length": n}
        if reason is not None:
            self._finish(req, reason)
        else:
            self._notify(req, False)
