"""The engine's weight refits: from a checkpoint directory or from arrays handed over in-process.

`EngineWeights` is the part of `osworld_jax.server.engine.Engine` that replaces the served
parameters between two engine steps (each method posts a command to the engine thread); after
every refit the engine forgets its kept KV and digests what it now serves
(`osworld_jax.model.digest.params_digest`), which the reply carries for the client's bit-exact
check (`osworld_jax.contract.refit`).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax

from osworld_jax.contract.errors import EngineError
from osworld_jax.model.digest import params_digest
from osworld_jax.server.refit_check import (
    CheckpointMismatch,
    CheckpointSignature,
    check_checkpoint_files,
    checkpoint_signature,
    first_difference,
)

if TYPE_CHECKING:
    from osworld_jax.server.prefix_cache import PrefixCache
    from osworld_jax.server.requests import GenRequest
    from osworld_jax.server.runner import ModelRunner


class Refit(NamedTuple):
    """What a refit did: ``success``, ``message``, requests running when it began, and the
    digest of the weights now served (`osworld_jax.model.digest.params_digest`; None when the
    refit failed)."""  # noqa: D205, D209

    success: bool
    message: str
    num_paused_requests: int = 0
    digest: str | None = None


def check_params(served: Any, params: Any) -> None:
    """Raises `EngineError` naming the first way ``params`` is not the ``served`` tree."""
    have = jax.tree_util.tree_flatten_with_path(served)[0]
    try:
        got = jax.tree_util.tree_flatten_with_path(params)[0]
    except Exception as e:  # not a tree of arrays at all
        raise EngineError(f"the new weights are not a parameter tree ({e})") from None
    names = {jax.tree_util.keystr(p): v for p, v in got}
    for path, old in have:
        key = jax.tree_util.keystr(path)
        new = names.pop(key, None)
        if new is None:
            raise EngineError(f"the new weights have no {key}")
        if tuple(new.shape) != tuple(old.shape) or new.dtype != old.dtype:
            raise EngineError(
                f"{key} is {new.dtype}{list(new.shape)}, the served one "
                f"{old.dtype}{list(old.shape)}"
            )
    if names:
        raise EngineError(f"the new weights have {sorted(names)[0]}, which the model has not")


class EngineWeights:
    """The refits of `Engine` (a base class: it uses the engine's runner, slots and thread)."""

    runner: ModelRunner
    prefix: PrefixCache
    slots: list[GenRequest | None]
    model_path: str
    signature: CheckpointSignature
    weight_version: str

    def _call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        raise NotImplementedError

    def _abort_matching(self, pred: Callable[[GenRequest], bool], message: str) -> int:
        raise NotImplementedError

    def update_weights(
        self,
        model_path: str,
        weight_version: str | None,
        abort_all: bool,
        signature: CheckpointSignature | None = None,
    ) -> concurrent.futures.Future[Refit]:
        """Loads ``model_path`` between steps (``/update_weights_from_disk``).

        A checkpoint whose config or tensor names / shapes differ from the served one is
        refused before anything is aborted or loaded (the message names the first
        difference); on any failure the served weights stay as they were. ``signature``: the
        checkpoint's, read beforehand off the engine thread (the HTTP handler does, with a
        deadline); else it is read here.
        """

        def run() -> Refit:
            running = sum(r is not None for r in self.slots)
            try:
                new = signature or checkpoint_signature(model_path)
                check_checkpoint_files(model_path)  # still regular files, just before loading
            except CheckpointMismatch as e:
                return Refit(False, f"refused {model_path}: {e}", running)
            diff = first_difference(self.signature, new)
            if diff is not None:
                return Refit(False, f"refused {model_path}: {diff} (still serving the old weights)")
            if abort_all:
                self._abort_matching(lambda r: True, "aborted by /update_weights_from_disk")
            try:
                self.runner.load_weights(model_path)
            except Exception as e:
                why = f"failed to load {model_path}: {type(e).__name__}: {e}"
                return Refit(False, why, running)
            self.model_path, self.signature = str(model_path), new
            return self._refitted(weight_version, running)

        return self._call(run)

    def update_weights_from_params(
        self, params: Any, weight_version: str | None, abort_all: bool
    ) -> concurrent.futures.Future[Refit]:
        """Serves ``params`` between steps: arrays handed over in this process, no file.

        ``params`` must have the served tree's structure, shapes and dtypes (else refused, the
        first difference named, the served weights kept); they are placed on the served
        parameters' shardings (``jax.device_put``: no copy where they already are).
        """

        def run() -> Refit:
            running = sum(r is not None for r in self.slots)
            try:
                check_params(self.runner.params, params)
            except EngineError as e:
                return Refit(False, f"refused: {e} (still serving the old weights)")
            if abort_all:
                self._abort_matching(lambda r: True, "aborted by /update_weights_from_tensor")
            # onto each served leaf's sharding: arrays already there (the trainer's cast on
            # the same device) are taken as they are; the old ones return to the pool
            shardings = jax.tree.map(lambda x: x.sharding, self.runner.params)
            self.runner.params = jax.device_put(params, shardings)
            return self._refitted(weight_version, running)

        return self._call(run)

    def _refitted(self, weight_version: str | None, running: int) -> Refit:
        """After new weights are in place (engine thread): forget old KV, name the version."""
        self.prefix.clear()  # kept KV belongs to the old weights
        if weight_version is not None:
            self.weight_version = weight_version
        digest = params_digest(self.runner.params)
        return Refit(True, "Succeeded to update model weights.", running, digest)
