"""``OwnerAgent``: the env's agent protocol for one logical owner, recording its history."""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from osworld_jax.agent.config import AgentConfig
from osworld_jax.agent.context import ContextManager
from osworld_jax.agent.errors import AgentCallError, WeightVersionError
from osworld_jax.agent.history import CallRecord, History
from osworld_jax.agent.segments import Segment, build_segments
from osworld_jax.errors import InfraError

_DECIMAL = re.compile(r"[0-9]+")

if TYPE_CHECKING:
    from osworld_jax.agent.tokenizer import AgentTokenizer
    from osworld_jax.env.agent_env import OwnerResult
    from osworld_jax.env.backend import Observation
    from osworld_jax.rollout import Generation, SamplingParams


def weight_version_number(
    version: str, *, aliases: Mapping[str, int] | None = None, owner_id: int | None = None
) -> int:
    """The step number of a server weight version: ``"12"`` -> 12, or ``aliases[version]``.

    Only ASCII decimal digits count (no sign, spaces or underscores); ``aliases`` is checked
    first (e.g. ``{"default": 0}``: servers launched without ``--weight-version``).

    Raises:
      WeightVersionError: one line naming the owner (when given) and the version.
    """
    if aliases is not None and version in aliases:
        return int(aliases[version])
    if isinstance(version, str) and _DECIMAL.fullmatch(version):
        return int(version)
    who = f"owner {owner_id}: " if owner_id is not None else ""
    known = f" or one of {sorted(aliases)}" if aliases else ""
    raise WeightVersionError(
        f"{who}weight version {version!r} is not a step number (decimal digits{known}); "
        "launch the servers with --weight-version 0 or map it with aliases"
    )


class GenerateClient(Protocol):
    """What the agent needs of ``osworld_jax.rollout.SGLangClient``."""

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        rid: str,
        routed_experts_start_len: int = 0,
        image_data: list[str] | None = None,
    ) -> Generation:
        """Returns a ``Generation`` (output ids, logprobs, routed experts, finish reason, ...).

        ``image_data`` (only passed when the prompt has images): base64 PNGs filling the
        prompt's image placeholders in order (SGLang's ``image_data``).
        """
        ...


@dataclass(frozen=True, kw_only=True, eq=False)
class OwnerRollout:
    """One logical owner's outcome, ready for advantages and packing.

    Attributes:
      owner_id: the logical owner (its index in the step's owner list).
      group_id: the owner's prompt group.
      segments: its training segments (empty for a failed owner).
      reward: the evaluator's reward (None when the owner failed).
      failed: an infrastructure failure masked this owner.
      error: the failure's message, or None.
    """

    owner_id: int
    group_id: int
    segments: tuple[Segment, ...]
    reward: float | None
    failed: bool
    error: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", tuple(self.segments))
        if not self.failed and self.reward is None:
            raise ValueError(f"owner {self.owner_id}: a healthy owner needs a reward")

    @property
    def num_trainable(self) -> int:
        """Trainable tokens over all segments."""
        return sum(s.num_trainable for s in self.segments)

    def trainable_tokens_by_version(self) -> dict[str, int]:
        """Tokens with loss mask 1 per weight version that generated them, over all segments.

        Versions are the servers' strings (``meta_info.weight_version``), in order of first
        appearance; empty for a failed owner or one without trainable tokens. The counts sum to
        `num_trainable`.
        """
        out: dict[str, int] = {}
        for s in self.segments:
            for v, k in s.trainable_tokens_by_version().items():
                out[v] = out.get(v, 0) + k
        return out

    def weight_version_range(
        self, aliases: Mapping[str, int] | None = None
    ) -> tuple[int, int] | None:
        """(oldest, newest) weight version of any trainable token, as step numbers.

        The RL loop refits to ``str(step)``, so a version is the number of optimizer steps
        behind the weights; the staleness of the owner when training step ``s`` is
        ``s - 1 - oldest`` (rolled out entirely by the weights step ``s`` starts from: 0).
        ``aliases`` maps non-numeric versions to steps, e.g. ``{"default": 0}`` for servers
        launched without ``--weight-version`` (SGLang's and the embedded server's default is
        ``"default"``, the base model's weights).

        Returns:
          None for a failed owner or one without trainable tokens.

        Raises:
          WeightVersionError: a version is neither a decimal number nor in ``aliases``.
        """
        steps = [
            weight_version_number(v, aliases=aliases, owner_id=self.owner_id)
            for v in self.trainable_tokens_by_version()
        ]
        return (min(steps), max(steps)) if steps else None


class OwnerAgent:
    """Drives one owner: observation -> prompt ids -> ``/generate`` -> reply text.

    A ``length`` finish is data (the reply is what the model produced). A transport or server
    failure raises an ``InfraError`` (the env marks the owner failed). Every call and declared
    compaction goes into ``history``. ``action_space`` is the env's (``AgentEnvConfig``): the
    system prompt describes what the env parses.

    Attributes:
      history: the recorded calls and compactions.
      context: the owner's context manager.
      result: the env's ``OwnerResult`` once the episode ended (``on_episode_end``).
      cached_tokens / served_tokens: prompt tokens of this owner's calls that the server took
        from its prefix cache / that it was sent (`Generation.cached_tokens`), summed.
    """

    def __init__(
        self,
        client: GenerateClient,
        tokenizer: AgentTokenizer,
        config: AgentConfig,
        *,
        owner_id: int,
        group_id: int,
        sampling: SamplingParams,
        rid_prefix: str | None = None,
        action_space: str = "pyautogui",
    ) -> None:
        self.client = client
        self.config = config
        self.sampling = sampling
        self.context = ContextManager(tokenizer, config, action_space=action_space)
        self.history = History(
            owner_id=owner_id,
            group_id=group_id,
            media_token_ids=self.context.media_token_ids(),
            image_token_id=self.context.image_token_id,
        )
        self._rid_prefix = rid_prefix or uuid.uuid4().hex[:12]
        self.result: OwnerResult | None = None
        self.cached_tokens = self.served_tokens = 0

    @property
    def owner_id(self) -> int:
        """The logical owner."""
        return self.history.owner_id

    @property
    def group_id(self) -> int:
        """The owner's prompt group."""
        return self.history.group_id

    async def act(self, observation: Observation) -> str:
        """The model's raw reply text to ``observation`` (the env parses it into an action)."""
        prompt, compaction = self.context.next_prompt(observation)
        if compaction is not None:
            self.history.declare_compaction(compaction)
        call_index = self.history.num_calls
        room = self.config.compaction.max_context_tokens - int(prompt.size)
        sampling = self.sampling.replace(max_new_tokens=min(self.sampling.max_new_tokens, room))
        rid = f"{self._rid_prefix}-g{self.group_id}-o{self.owner_id}-c{call_index}"
        start = 0
        if self.config.incremental_routes:
            # The previous output's last token was never an input: its route comes with this
            # call (and so do those of a reply whose generated media tokens became text).
            start = self.context.routed_prefix
        images = self.context.prompt_images
        extra = {"image_data": [im.image_data for im in images]} if images else {}
        try:
            gen = await self.client.generate(
                prompt.tolist(), sampling, rid=rid, routed_experts_start_len=start, **extra
            )
        except InfraError:
            self.context.abandon_prompt()
            raise
        except (TimeoutError, OSError) as e:
            self.context.abandon_prompt()
            raise AgentCallError(
                f"owner {self.owner_id} call {call_index} (rid {rid}): transport failure: {e!r}"
            ) from e
        self.cached_tokens += gen.cached_tokens
        self.served_tokens += gen.served_tokens
        record = self._record(prompt, gen, rid, call_index)
        self.history.record_call(record)
        self.context.record_reply(record.output_ids, record.text, trainable=record.trainable)
        return record.text

    def _record(self, prompt: np.ndarray, gen: Generation, rid: str, call_index: int) -> CallRecord:
        """Checks the reply's shapes and turns it into a ``CallRecord``."""

        def fail(msg: str) -> AgentCallError:
            self.context.abandon_prompt()
            return AgentCallError(f"owner {self.owner_id} call {call_index} (rid {rid}): {msg}")

        reason = dict(gen.finish_reason or {})
        if reason.get("type") not in ("stop", "length"):
            raise fail(f"unusable finish reason {reason!r}")
        out = np.asarray(gen.output_ids, np.int32).reshape(-1)
        lps = np.asarray(gen.output_logprobs, np.float32).reshape(-1)
        if lps.size != out.size:
            raise fail(f"{lps.size} logprobs for {out.size} output tokens")
        routes = gen.routed_experts
        start = int(gen.routed_experts_start_len)
        if routes is not None:
            routes = np.asarray(routes, np.int32)
            rows = prompt.size + out.size - 1 - start
            if routes.ndim != 3 or routes.shape[0] != rows:
                raise fail(
                    f"routed_experts shape {tuple(routes.shape)}, expected [{rows}, L, K] "
                    f"(prompt + output - 1 - start {start} rows)"
                )
        # Generated media tokens stay in the history as text (a later prompt must not hold a
        # placeholder without an image); from the first one on the reply is not trainable and
        # its routes are unknown (the server routes that part again in the next call).
        kept, j = self.context.media_as_text(out)
        trainable = None
        versions, lengths = _cut_parts(gen.weight_versions, gen.part_lengths, min(j, out.size))
        if j < out.size:
            trainable = j
            lps = np.concatenate([lps[:j], np.zeros(kept.size - j, np.float32)])
            if routes is not None:
                valid = max(prompt.size + j - start, 0)
                full = np.full((prompt.size + kept.size - 1 - start, *routes.shape[1:]), -1)
                full[:valid] = routes[:valid]
                routes = full.astype(np.int32)
        return CallRecord(
            prompt_ids=prompt,
            output_ids=kept,
            output_logprobs=lps,
            routed_experts=routes,
            finish_reason=reason,
            weight_version=str(gen.weight_version),
            rid=rid,
            text=str(gen.text),
            routed_experts_start=start,
            images=tuple(im.png for im in self.context.prompt_images),
            trainable=trainable,
            weight_versions=versions,
            part_lengths=lengths,
        )

    async def on_episode_end(self, result: OwnerResult) -> None:
        """Keeps the env's ``OwnerResult`` (reward, failed, error) for ``to_rollout``."""
        self.result = result

    def segments(self) -> list[Segment]:
        """The owner's training segments (raises ``SegmentIntegrityError`` on a prefix break)."""
        return build_segments(self.history)

    def to_rollout(self, result: OwnerResult | None = None) -> OwnerRollout:
        """The owner's ``OwnerRollout`` from its history and the env's ``OwnerResult``.

        A failed owner keeps no segments (it becomes one masked placeholder row).
        """
        result = self.result if result is None else result
        if result is None:
            raise ValueError(f"owner {self.owner_id}: the episode has no result yet")
        if result.failed:
            return OwnerRollout(
                owner_id=self.owner_id,
                group_id=self.group_id,
                segments=(),
                reward=None,
                failed=True,
                error=result.error,
            )
        if result.reward is None:
            raise ValueError(f"owner {self.owner_id}: a healthy episode without a reward")
        return OwnerRollout(
            owner_id=self.owner_id,
            group_id=self.group_id,
            segments=tuple(self.segments()),
            reward=float(result.reward),
            failed=False,
            error=result.error,
        )


def _cut_parts(
    versions: tuple[str, ...], lengths: tuple[int, ...], n: int
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The per-part versions / lengths of the first ``n`` output tokens (later parts dropped)."""
    out_v: list[str] = []
    out_k: list[int] = []
    left = n
    for v, k in zip(versions, lengths, strict=True):
        if left == 0 and out_v:
            break
        take = min(int(k), left)
        out_v.append(str(v))
        out_k.append(take)
        left -= take
    return tuple(out_v), tuple(out_k)
