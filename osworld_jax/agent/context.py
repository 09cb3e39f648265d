r"""Token-in/token-out context of one owner, with declared compactions.

Call ``i + 1``'s prompt is call ``i``'s prompt + its output ids + the ids of the new observation
turn, appended and never re-tokenised, so consecutive prompts extend each other token-exactly. The
new turn's ids come from the chat template itself: the template is rendered over a stand-in
history ending in an assistant message with a sentinel content, followed by the new user turn and
the generation prompt; everything after the sentinel is the turn suffix (for ChatML:
``<|im_end|>\n<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n``). When the model's
output already ends with the suffix's first token (it stopped on ``<|im_end|>``), that token is
not repeated.

A compaction (every K actions, or when the next prompt would pass the budget) re-renders the
context from messages: system prompt, the instruction with a compact action history of the
dropped turns, and the last N observations with the replies between them.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from osworld_jax.agent.config import AgentConfig
from osworld_jax.agent.errors import ChatTemplateError, ContextOverflowError
from osworld_jax.agent.history import Compaction
from osworld_jax.agent.prompts import (
    action_history_block,
    neutralize_special,
    render_observation,
    system_prompt,
)

if TYPE_CHECKING:
    from osworld_jax.agent.template import AgentTokenizer
    from osworld_jax.env.backend import Observation

_SENTINEL = "\u2063OSWORLD_JAX_TURN_SENTINEL\u2063"


@dataclasses.dataclass
class _Turn:
    """One observation (as user-turn text) and the model's reply to it."""

    obs: Observation
    text: str
    reply: str | None = None


class ContextManager:
    """Builds one owner's prompt ids turn by turn (see the module docstring).

    Use: ``ids, compaction = ctx.next_prompt(obs)``; generate; ``ctx.record_reply(output_ids,
    text)``; repeat.

    Args (constructor): ``tokenizer``, ``config`` and the env's ``action_space`` (the system
    prompt describes it).

    Attributes:
      config: the prompting config.
      tokenizer: tokenizer + chat template.
    """

    def __init__(
        self, tokenizer: AgentTokenizer, config: AgentConfig, *, action_space: str = "pyautogui"
    ) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self._system = system_prompt(config, action_space)
        self._turns: list[_Turn] = []
        self._instruction: str | None = None
        self._context: np.ndarray | None = None  # last prompt + last output
        self._prompt: np.ndarray | None = None
        self._first_kept = 0  # index of the first observation in the current context
        self._actions_since_rebuild = 0
        self._num_calls = 0
        self._extended = 0  # tokens of the pending prompt that extend the previous context

    @property
    def extended_prefix(self) -> int:
        """Leading tokens of the pending prompt that are the previous prompt + output.

        0 after a (re)build. All but the last of them already have routes in the segment.
        """
        return self._extended

    @property
    def num_calls(self) -> int:
        """Replies recorded so far."""
        return self._num_calls

    def media_token_ids(self) -> frozenset[int]:
        """Ids of the media tokens present in the vocabulary (the span's must be)."""
        ids = set()
        for tok in self.config.media_tokens:
            i = self.tokenizer.token_id(tok)
            if (
                i is None
                and self.config.image_tokens > 0
                and tok not in (self.config.extra_media_tokens)
            ):
                raise ChatTemplateError(
                    f"AgentConfig.image_tokens > 0 but the media token {tok!r} is not in the "
                    "tokenizer's vocabulary"
                )
            if i is not None:
                ids.add(i)
        return frozenset(ids)

    # -- messages ---------------------------------------------------------------------------

    def _first_user(self, history_block: str, obs_text: str) -> str:
        instruction = neutralize_special(self._instruction or "", self.tokenizer.special_tokens)
        parts = [f"Task instruction: {instruction}"]
        if history_block:
            parts.append(history_block)
        parts.append(obs_text)
        return "\n\n".join(parts)

    def _messages(self, first: int, last_text: str | None = None) -> list[dict[str, str]]:
        """System + the turns ``first..end`` (earlier replies summarised), last turn unanswered."""
        replies = [t.reply or "" for t in self._turns[:first]]
        block = action_history_block(replies, self.config) if first else ""
        msgs = [{"role": "system", "content": self._system}]
        kept = self._turns[first:]
        for k, turn in enumerate(kept):
            text = last_text if (last_text is not None and k == len(kept) - 1) else turn.text
            msgs.append(
                {"role": "user", "content": self._first_user(block, text) if k == 0 else text}
            )
            if k < len(kept) - 1:
                msgs.append({"role": "assistant", "content": turn.reply or ""})
        return msgs

    def _render_ids(self, msgs: list[dict[str, str]]) -> np.ndarray:
        return self.tokenizer.encode(
            self.tokenizer.template.render(msgs, add_generation_prompt=True)
        )

    def _turn_suffix(self, obs_text: str) -> np.ndarray:
        """Ids that close the assistant reply and open the next user turn + generation prompt."""
        msgs = [
            {"role": "system", "content": self._system},
            {"role": "user", "content": "."},
            {"role": "assistant", "content": _SENTINEL},
            {"role": "user", "content": obs_text},
        ]
        text = self.tokenizer.template.render(msgs, add_generation_prompt=True)
        at = text.rfind(_SENTINEL)
        if at < 0:
            raise ChatTemplateError(
                f"{self.tokenizer.template.name}: an assistant message's content does not appear "
                "in the rendered chat (cannot append turns token-exactly)"
            )
        return self.tokenizer.encode(text[at + len(_SENTINEL) :])

    # -- turns ------------------------------------------------------------------------------

    def next_prompt(self, obs: Observation) -> tuple[np.ndarray, Compaction | None]:
        """The prompt ids for the reply to ``obs``, and the compaction declared before it (if any).

        Raises:
          ContextOverflowError: even the most compact context exceeds the prompt budget.
          ChatTemplateError: the template cannot be appended to token-exactly.
        """
        if self._prompt is not None:
            raise RuntimeError("next_prompt called twice without record_reply")
        if self._instruction is None:
            self._instruction = obs.instruction
        cfg = self.config.compaction
        self._turns.append(
            _Turn(obs=obs, text=render_observation(obs, self.config, self.tokenizer))
        )
        compaction = None
        self._extended = 0
        if self._context is None:
            prompt = self._rebuild(first=0)
        else:
            reason = None
            prompt = None
            if cfg.every_k_actions and self._actions_since_rebuild >= cfg.every_k_actions:
                reason = "every_k_actions"
            else:
                suffix = self._turn_suffix(self._turns[-1].text)
                out = self._context
                if out.size and suffix.size and out[-1] == suffix[0]:
                    suffix = suffix[1:]
                prompt = np.concatenate([out, suffix]).astype(np.int32)
                if prompt.size > cfg.prompt_budget:
                    reason = "budget"
                else:
                    self._extended = int(out.size)
            if reason is not None:
                before = int(self._context.size)
                keep = min(cfg.keep_last_observations, len(self._turns))
                prompt = self._rebuild(first=len(self._turns) - keep)
                compaction = Compaction(
                    before_call=self._num_calls,
                    reason=reason,
                    dropped_observations=self._first_kept,
                    kept_observations=len(self._turns) - self._first_kept,
                    tokens_before=before,
                    tokens_after=int(prompt.size),
                )
        assert prompt is not None
        self._prompt = prompt
        return prompt, compaction

    def _rebuild(self, first: int) -> np.ndarray:
        """Renders turns ``first..`` (keeping fewer, then shrinking the a11y tree, to fit)."""
        budget = self.config.compaction.prompt_budget
        n = len(self._turns)
        for start in range(first, n):
            ids = self._render_ids(self._messages(start))
            if ids.size <= budget:
                self._set_rebuilt(start)
                return ids
        chars = self.config.a11y_max_chars
        while chars > 0:
            chars //= 2
            text = render_observation(
                self._turns[-1].obs, self.config, self.tokenizer, a11y_max_chars=chars
            )
            ids = self._render_ids(self._messages(n - 1, last_text=text))
            if ids.size <= budget:
                self._turns[-1].text = text
                self._set_rebuilt(n - 1)
                return ids
        raise ContextOverflowError(
            f"the most compact context ({ids.size} tokens: system prompt, instruction, action "
            f"history, one observation without accessibility tree) exceeds the prompt budget "
            f"{budget} (CompactionConfig.max_context_tokens - reserved_generation_tokens)"
        )

    def _set_rebuilt(self, first: int) -> None:
        self._first_kept = first
        self._actions_since_rebuild = 0

    def record_reply(self, output_ids: np.ndarray, text: str) -> None:
        """Appends the model's output ids (token-exact) and remembers the reply text.

        The text is only re-rendered by a compaction (as an earlier turn of a new segment); a
        special-token string the model wrote as plain text is neutralised there.
        """
        if self._prompt is None:
            raise RuntimeError("record_reply called without a pending prompt")
        self._context = np.concatenate([self._prompt, np.asarray(output_ids, np.int32)])
        self._turns[-1].reply = neutralize_special(text, self.tokenizer.special_tokens)
        self._prompt = None
        self._actions_since_rebuild += 1
        self._num_calls += 1

    def abandon_prompt(self) -> None:
        """Forgets a pending prompt whose call failed (the owner is failed; no reply follows)."""
        self._prompt = None
