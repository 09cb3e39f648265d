r"""Token-in/token-out context of one owner, with declared compactions.

Call ``i + 1``'s prompt is call ``i``'s prompt + its output ids + the ids of the new observation
turn, appended and never re-tokenised, so consecutive prompts extend each other token-exactly. The
new turn's ids come from the chat template itself: the template is rendered over a stand-in
history ending in an assistant message with a sentinel content, followed by the new user turn and
the generation prompt; everything after the sentinel is the turn suffix (for ChatML:
``<|im_end|>\n<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n``). When the model's
output already ends with the suffix's first token (it stopped on ``<|im_end|>``), that token is
not repeated.

Screenshots (a model with an image processor, ``AgentConfig.max_screenshots > 0``): a turn's
user content is ``[text "Screenshot: ", image, text observation]``, rendered by the model's own
template (one ``<|image_pad|>`` per image, as HF processors see it) and then expanded to the
processor's token count of that screenshot (``ImageProcessor.num_image_tokens``), so the ids are
exactly what the server and the trainer see. Only the last ``max_screenshots`` screenshots are
shown; when a new one would pass that, the context is rebuilt showing only the last
``screenshots_after_compaction`` (the low-water mark, the new one included; the others become
text placeholders), a declared compaction (reason ``screenshots``); the following turns extend
the rebuilt context until the window is full again, so one segment trains several replies. At a
compaction the observation text of kept turns older than the window becomes a short placeholder
(``placeholder_old_observations``). ``max_active_images`` caps the images of any prompt.

With ``protect_initial_observation`` (the seed's "initial context protected") the first
observation, with the instruction and its screenshot, is rendered verbatim in every prompt
before the action history: it is never compacted, its screenshot is shown outside the window
(but within ``max_active_images``) and its text is never a placeholder.

A compaction (every K actions, or when the next prompt would pass the budget) re-renders the
context from messages: system prompt, the instruction with a compact action history of the
dropped turns, and the last N observations with the replies between them.
"""

from __future__ import annotations

import base64
import dataclasses
import io
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from osworld_jax.agent.config import AgentConfig
from osworld_jax.agent.errors import AgentCallError, ChatTemplateError, ContextOverflowError
from osworld_jax.agent.history import Compaction
from osworld_jax.agent.prompts import (
    SCREENSHOT_DROPPED,
    action_history_block,
    neutralize_special,
    render_observation,
    system_prompt,
)

if TYPE_CHECKING:
    from osworld_jax.agent.tokenizer import AgentTokenizer
    from osworld_jax.env.backend import Observation

_SENTINEL = "\u2063OSWORLD_JAX_TURN_SENTINEL\u2063"
#: What an old observation's text (accessibility tree, terminal) becomes at a compaction.
OBSERVATION_DROPPED = "(accessibility tree and terminal removed: older than the kept screenshots)"


@dataclasses.dataclass(frozen=True, eq=False)
class Screenshot:
    """One screenshot as the prompt carries it.

    Attributes:
      png: the PNG bytes the sandbox returned (what the server and the trainer process).
      tokens: its ``<|image_pad|>`` count, from the model's image processor.
    """

    png: bytes
    tokens: int

    @property
    def image_data(self) -> str:
        """Base64 of the PNG: one entry of SGLang's ``image_data``."""
        cached = self.__dict__.get("_b64")
        if cached is None:
            cached = base64.b64encode(self.png).decode("ascii")
            object.__setattr__(self, "_b64", cached)
        return cached


@dataclasses.dataclass
class _Turn:
    """One observation (its text, its screenshot) and the model's reply to it.

    ``shown``: its screenshot is an image of the current context (else a placeholder).
    """

    obs: Observation
    text: str
    image: Screenshot | None = None
    reply: str | None = None
    shown: bool = False


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
        self._protected = config.protected_observations  # leading turns never compacted
        self._actions_since_rebuild = 0
        self._num_calls = 0
        self._extended = 0  # tokens of the pending prompt that extend the previous context
        self._routed = 0  # leading context tokens the server has routed in this context's form
        self._prompt_images: tuple[Screenshot, ...] = ()
        ids = {t: tokenizer.token_id(t) for t in config.media_tokens}
        self._pad_id = ids[config.image_pad_token]
        self._media_text: dict[int, np.ndarray] = {
            i: tokenizer.encode(neutralize_special(t, tokenizer.special_tokens))
            for t, i in ids.items()
            if i is not None
        }
        processor = tokenizer.image_processor
        self.images_on = config.max_screenshots > 0 and processor is not None
        if self.images_on:
            self.media_token_ids()  # the span's tokens must exist

    @property
    def extended_prefix(self) -> int:
        """Leading tokens of the pending prompt that are the previous prompt + output.

        0 after a (re)build.
        """
        return self._extended

    @property
    def routed_prefix(self) -> int:
        """Leading tokens of the pending prompt whose routes the previous call returned.

        ``len(previous prompt + output) - 1`` (the last output token was never an input), or
        less when a generated media token was replaced by its text (the server routes the
        replaced part again). 0 after a (re)build.
        """
        return min(self._routed, self._extended)

    @property
    def prompt_images(self) -> tuple[Screenshot, ...]:
        """The screenshots of the pending prompt, in placeholder order."""
        return self._prompt_images

    @property
    def num_calls(self) -> int:
        """Replies recorded so far."""
        return self._num_calls

    def media_token_ids(self) -> frozenset[int]:
        """Ids of the media tokens present in the vocabulary (the span's must be with images)."""
        ids = set()
        for tok in self.config.media_tokens:
            i = self.tokenizer.token_id(tok)
            if i is None and self.images_on and tok not in self.config.extra_media_tokens:
                raise ChatTemplateError(
                    f"the model has an image processor and AgentConfig.max_screenshots > 0, but "
                    f"the media token {tok!r} is not in the tokenizer's vocabulary"
                )
            if i is not None:
                ids.add(i)
        return frozenset(ids)

    @property
    def image_token_id(self) -> int | None:
        """The ``<|image_pad|>`` id when prompts carry images, else None."""
        return self._pad_id if self.images_on else None

    def media_as_text(self, output_ids: np.ndarray) -> tuple[np.ndarray, int]:
        """Generated ids with every media token replaced by the ids of its (neutralised) text.

        Returns ``(ids, j)``: ``j`` is the index of the first replaced token (``len(ids)`` when
        none was), so ``ids[:j]`` are exactly the generated ids.
        """
        out = np.asarray(output_ids, np.int32).reshape(-1)
        hits = np.flatnonzero(np.isin(out, list(self._media_text)))
        if not hits.size:
            return out, int(out.size)
        j = int(hits[0])
        pieces = [out[:j]]
        for tok in out[j:]:
            pieces.append(self._media_text.get(int(tok), np.asarray([tok], np.int32)))
        return np.concatenate(pieces).astype(np.int32), j

    def _screenshot(self, obs: Observation) -> Screenshot | None:
        """The observation's screenshot with its token count (None with images off)."""
        if not self.images_on or obs.screenshot is None:
            return None
        processor = self.tokenizer.image_processor
        assert processor is not None
        try:
            with Image.open(io.BytesIO(obs.screenshot)) as im:
                width, height = im.size
            tokens = processor.num_image_tokens(height, width)
        except Exception as e:  # noqa: BLE001 - Pillow raises several types for bad data
            raise AgentCallError(
                f"the observation's screenshot ({len(obs.screenshot)} bytes) is not a usable "
                f"image: {e}"
            ) from e
        return Screenshot(png=bytes(obs.screenshot), tokens=tokens)

    # -- messages ---------------------------------------------------------------------------

    def _first_user(self, history_block: str) -> str:
        instruction = neutralize_special(self._instruction or "", self.tokenizer.special_tokens)
        parts = [f"Task instruction: {instruction}"]
        if history_block:
            parts.append(history_block)
        return "\n\n".join(parts) + "\n\n"

    def _content(self, turn: _Turn, prefix: str, text: str) -> str | list[dict[str, Any]]:
        """The user content of ``turn``: a string, or text + image parts when it is shown."""
        if turn.image is None:
            return prefix + text
        body = "\n\n" + text if text else ""
        if not turn.shown:
            dropped = SCREENSHOT_DROPPED.format(k=self.config.screenshot_window)
            return f"{prefix}Screenshot: {dropped}{body}"
        parts: list[dict[str, Any]] = [
            {"type": "text", "text": prefix + "Screenshot: "},
            {"type": "image"},
        ]
        if body:
            parts.append({"type": "text", "text": body})
        return parts

    def _messages(self, first: int, last_text: str | None = None) -> list[dict[str, Any]]:
        """System + the turns ``first..end`` (earlier replies summarised), last turn unanswered.

        A protected first observation (``first > 0``) comes first, verbatim with its reply;
        the history then summarises turns ``1..first - 1``.
        """
        msgs: list[dict[str, Any]] = [{"role": "system", "content": self._system}]
        protected = min(self._protected, first)
        if protected:
            turn = self._turns[0]
            prefix = self._first_user("")
            msgs.append({"role": "user", "content": self._content(turn, prefix, turn.text)})
            msgs.append({"role": "assistant", "content": turn.reply or ""})
        replies = [t.reply or "" for t in self._turns[protected:first]]
        block = (
            action_history_block(replies, self.config, first_step=protected + 1) if replies else ""
        )
        kept = self._turns[first:]
        for k, turn in enumerate(kept):
            text = last_text if (last_text is not None and k == len(kept) - 1) else turn.text
            if k == 0:
                prefix = (block + "\n\n" if block else "") if protected else self._first_user(block)
            else:
                prefix = ""
            msgs.append({"role": "user", "content": self._content(turn, prefix, text)})
            if k < len(kept) - 1:
                msgs.append({"role": "assistant", "content": turn.reply or ""})
        return msgs

    def _expand_images(self, ids: np.ndarray, images: list[Screenshot]) -> np.ndarray:
        """Each rendered ``<|image_pad|>`` -> the processor's count of its screenshot."""
        if not self.images_on:
            return ids
        at = np.flatnonzero(ids == self._pad_id)
        if at.size != len(images):
            raise ChatTemplateError(
                f"{self.tokenizer.template.name}: the chat template rendered {at.size} image "
                f"placeholder(s) for {len(images)} screenshot(s) (it must render each image "
                "content part as one <|image_pad|>)"
            )
        if not images:
            return ids
        counts = np.ones(ids.size, np.int64)
        counts[at] = [im.tokens for im in images]
        return np.repeat(ids, counts).astype(np.int32)

    def _render_ids(self, msgs: list[dict[str, Any]], images: list[Screenshot]) -> np.ndarray:
        ids = self.tokenizer.encode(
            self.tokenizer.template.render(msgs, add_generation_prompt=True)
        )
        return self._expand_images(ids, images)

    def _turn_suffix(self, turn: _Turn) -> np.ndarray:
        """Ids that close the assistant reply and open the next user turn + generation prompt."""
        msgs: list[dict[str, Any]] = [
            {"role": "system", "content": self._system},
            {"role": "user", "content": "."},
            {"role": "assistant", "content": _SENTINEL},
            {"role": "user", "content": self._content(turn, "", turn.text)},
        ]
        text = self.tokenizer.template.render(msgs, add_generation_prompt=True)
        at = text.rfind(_SENTINEL)
        if at < 0:
            raise ChatTemplateError(
                f"{self.tokenizer.template.name}: an assistant message's content does not appear "
                "in the rendered chat (cannot append turns token-exactly)"
            )
        shown = [turn.image] if turn.shown and turn.image is not None else []
        return self._expand_images(self.tokenizer.encode(text[at + len(_SENTINEL) :]), shown)

    def _rendered(self, k: int) -> bool:
        """Turn ``k`` is part of the current context (kept, or the protected first one)."""
        return k < self._protected or k >= self._first_kept

    def _shown(self) -> list[Screenshot]:
        """The screenshots the current context shows, in order."""
        return [
            t.image
            for k, t in enumerate(self._turns)
            if self._rendered(k) and t.shown and t.image is not None
        ]

    def _window_shown(self) -> int:
        """Screenshots the window shows (the protected first one not counted)."""
        start = max(self._protected, self._first_kept)
        return sum(1 for t in self._turns[start:] if t.shown and t.image is not None)

    def _mark_shown(self, first: int, shots: int | None = None) -> None:
        """Shows the screenshots of the last ``shots`` turns from ``first`` that have one.

        ``shots`` defaults to the window (``AgentConfig.screenshot_window``). A protected first
        observation's screenshot is always shown, outside the window.
        """
        left = self.config.screenshot_window if shots is None else shots
        for k in range(len(self._turns) - 1, -1, -1):
            turn = self._turns[k]
            if k < self._protected:
                turn.shown = turn.image is not None
                continue
            turn.shown = k >= first and turn.image is not None and left > 0
            left -= turn.shown

    def _placeholder_old(self, first: int) -> None:
        """Old observation text of the kept turns -> `OBSERVATION_DROPPED` (at a compaction).

        Old: before the first turn whose screenshot is shown, or (none shown) before the last
        ``keep_last_observations`` turns. Turns before ``first`` are not rendered (the action
        history stands for them); a placeholder is permanent.
        """
        if not self.config.placeholder_old_observations:
            return
        n = len(self._turns)
        first = max(first, self._protected)  # a protected observation keeps its text
        shown = [k for k in range(first, n) if self._turns[k].shown]
        window = shown[0] if shown else n - self.config.compaction.keep_last_observations
        for turn in self._turns[first : min(window, n - 1)]:
            if len(turn.text) > len(OBSERVATION_DROPPED):
                turn.text = OBSERVATION_DROPPED

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
        image = self._screenshot(obs)
        text = render_observation(
            obs, self.config, self.tokenizer, with_screenshot=image is not None
        )
        self._turns.append(_Turn(obs=obs, text=text, image=image))
        compaction = None
        self._extended = 0
        if self._context is None:
            prompt = self._rebuild(first=0)
        else:
            reason = None
            prompt = None
            if cfg.every_k_actions and self._actions_since_rebuild >= cfg.every_k_actions:
                reason = "every_k_actions"
            elif image is not None and self._window_shown() >= self.config.screenshot_window:
                reason = "screenshots"
            else:
                self._turns[-1].shown = image is not None
                suffix = self._turn_suffix(self._turns[-1])
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
                if reason == "screenshots":
                    prompt = self._rebuild(self._first_kept, self.config.screenshot_low_water)
                else:
                    prompt = self._rebuild(len(self._turns) - keep)
                protected = min(self._protected, self._first_kept)
                compaction = Compaction(
                    before_call=self._num_calls,
                    reason=reason,
                    dropped_observations=self._first_kept - protected,
                    kept_observations=len(self._turns) - self._first_kept + protected,
                    tokens_before=before,
                    tokens_after=int(prompt.size),
                    screenshots=len(self._shown()),
                )
        assert prompt is not None
        self._prompt = prompt
        self._prompt_images = tuple(self._shown())
        return prompt, compaction

    def _rebuild(self, first: int, shots: int | None = None) -> np.ndarray:
        """Renders turns ``first..`` (keeping fewer, then shrinking the a11y tree, to fit).

        ``shots``: screenshots shown (default ``max_screenshots``); older observation text
        becomes a placeholder (`_placeholder_old`).
        """
        budget = self.config.compaction.prompt_budget
        n = len(self._turns)
        for start in range(first, n):
            self._mark_shown(start, shots)
            self._placeholder_old(start)
            self._first_kept = start
            ids = self._render_ids(self._messages(start), self._shown())
            if ids.size <= budget:
                self._set_rebuilt(start)
                return ids
        chars = self.config.a11y_max_chars
        last = self._turns[-1]
        while chars > 0:
            chars //= 2
            text = render_observation(
                last.obs,
                self.config,
                self.tokenizer,
                a11y_max_chars=chars,
                with_screenshot=last.image is not None,
            )
            ids = self._render_ids(self._messages(n - 1, last_text=text), self._shown())
            if ids.size <= budget:
                last.text = text
                self._set_rebuilt(n - 1)
                return ids
        shot = f", its screenshot ({last.image.tokens} tokens)" if last.shown and last.image else ""
        raise ContextOverflowError(
            f"the most compact context ({ids.size} tokens: system prompt, instruction, action "
            f"history, one observation{shot} without accessibility tree) exceeds the prompt "
            f"budget {budget} (CompactionConfig.max_context_tokens - reserved_generation_tokens)"
        )

    def _set_rebuilt(self, first: int) -> None:
        self._first_kept = first
        self._actions_since_rebuild = 0

    def record_reply(
        self, output_ids: np.ndarray, text: str, *, trainable: int | None = None
    ) -> None:
        """Appends the model's output ids (token-exact) and remembers the reply text.

        ``output_ids`` are the ids the context keeps (`media_as_text`); ``trainable`` is how many
        leading ones are exactly the generated ids (default all): the server routed the context
        up to there, and routes the rest again with the next call.

        The text is only re-rendered by a compaction (as an earlier turn of a new segment); a
        special-token string the model wrote as plain text is neutralised there.
        """
        if self._prompt is None:
            raise RuntimeError("record_reply called without a pending prompt")
        out = np.asarray(output_ids, np.int32).reshape(-1)
        same = out.size if trainable is None else trainable
        self._routed = self._prompt.size + (same if same < out.size else max(out.size - 1, -1))
        self._routed = max(self._routed, 0)
        self._context = np.concatenate([self._prompt, out])
        self._turns[-1].reply = neutralize_special(text, self.tokenizer.special_tokens)
        self._prompt = None
        self._actions_since_rebuild += 1
        self._num_calls += 1

    def abandon_prompt(self) -> None:
        """Forgets a pending prompt whose call failed (the owner is failed; no reply follows)."""
        self._prompt = None
        self._prompt_images = ()
