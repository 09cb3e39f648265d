"""Configs of the agent room: prompting, context compaction and the group policy."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from osworld_jax.errors import ConfigError
from osworld_jax.registry import check_choice

#: What a step does with a group below ``min_healthy_per_group``: train on the rest, or fail.
OnDroppedGroup = Literal["shrink", "fail"]

#: Who forms a group's baseline (docs/DESIGN.md, "Baseline population"):
#: ``logical_owners``, every logical owner of the group whose reward is known, each once however
#: many segments (rows) it has; an owner masked for an infrastructure failure or as stale has an
#: unknown reward and enters no statistic. ``all_owners`` (the seed's base recipe): every owner
#: the group drew, each once; a masked owner stays in as a placeholder with reward 0 (it counts
#: in the group's size, mean and std) and no tokens (weight 0 in token-weighted whitening); its
#: own row stays masked (advantage 0) either way.
BaselinePopulation = Literal["logical_owners", "all_owners"]
#: Former population names, refused with the reason (a recipe naming one fails loudly).
_RETIRED_POPULATIONS = {
    "healthy": "it is now called 'logical_owners'",
}


@dataclass(frozen=True, kw_only=True)
class CompactionConfig:
    """When and how the context of one owner is rewritten (a declared compaction).

    A compaction keeps the system prompt and the instruction, keeps the last
    ``keep_last_observations`` observations (with the model replies between them), and replaces
    every older turn by a compact numbered action history. It seals the current training segment.

    Attributes:
      every_k_actions: compact after this many actions since the last (re)build of the context;
        0 disables the periodic trigger.
      max_context_tokens: the model's context length in tokens (prompt + generation).
      reserved_generation_tokens: tokens kept free for the reply; a prompt longer than
        ``max_context_tokens - reserved_generation_tokens`` triggers a compaction.
      keep_last_observations: observations kept verbatim by a compaction (>= 1, the current one
        included).
      max_action_chars: each action of the compact history is cut to this many characters.
      max_history_actions: the compact history lists at most this many most recent actions (older
        ones are counted, not listed).
    """

    every_k_actions: int = 0
    max_context_tokens: int = 32768
    reserved_generation_tokens: int = 1024
    keep_last_observations: int = 1
    max_action_chars: int = 200
    max_history_actions: int = 50

    def __post_init__(self) -> None:
        if self.every_k_actions < 0:
            raise ConfigError(
                f"CompactionConfig.every_k_actions must be >= 0, got {self.every_k_actions}"
            )
        if self.reserved_generation_tokens < 1:
            raise ConfigError(
                "CompactionConfig.reserved_generation_tokens must be >= 1, got "
                f"{self.reserved_generation_tokens}"
            )
        if self.max_context_tokens <= self.reserved_generation_tokens:
            raise ConfigError(
                f"CompactionConfig.max_context_tokens ({self.max_context_tokens}) must exceed "
                f"reserved_generation_tokens ({self.reserved_generation_tokens})"
            )
        if self.keep_last_observations < 1:
            raise ConfigError(
                "CompactionConfig.keep_last_observations must be >= 1, got "
                f"{self.keep_last_observations}"
            )
        for name in ("max_action_chars", "max_history_actions"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"CompactionConfig.{name} must be >= 1, got {getattr(self, name)}"
                )

    @property
    def prompt_budget(self) -> int:
        """The longest prompt allowed: ``max_context_tokens - reserved_generation_tokens``."""
        return self.max_context_tokens - self.reserved_generation_tokens


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """How an owner's observations become prompt tokens.

    Attributes:
      system_prompt: replaces the built-in system prompt when not None (then it must state the
        action space and output format itself). The built-in one describes the action space the
        env parses (``AgentEnvConfig.action_space``, given to the agent) plus WAIT, DONE, FAIL.
      screen_width: screen width in pixels, stated in the system prompt.
      screen_height: screen height in pixels, stated in the system prompt.
      a11y_max_chars: the accessibility tree is cut (at line boundaries) to this many characters;
        0 drops it.
      a11y_max_tokens: then cut to this many tokens (at line boundaries); 0 means no token cap.
      terminal_max_chars: the terminal text keeps its last this-many characters; 0 drops it.
      max_screenshots: the prompt shows the last this-many screenshots; an older one becomes a
        short text placeholder, and that rewrite is a declared compaction (reason
        ``screenshots``). 0 drops screenshots. Screenshots are shown only to a model whose
        directory has an image processor (``preprocessor_config.json``, a Qwen3-VL model); its
        processor alone decides how many ``<|image_pad|>`` tokens each one takes.
      screenshots_after_compaction: the low-water mark of the screenshot window: a
        ``screenshots`` compaction (a new screenshot when ``max_screenshots`` are shown) rebuilds
        the prompt showing only this many (the new one included), so the next
        ``max_screenshots - screenshots_after_compaction`` turns extend the context token-exactly
        and one segment trains that many replies + 1. None: ``max_screenshots`` (the window
        slides by one: a new segment every turn once it is full, the former behaviour). Default
        1: a window of 3 trains 3 replies per segment, each row at most 3 screenshots
        (docs/DESIGN.md, "Screenshot window").
      max_active_images: at most this many images in any prompt, the protected first
        screenshot included (the seed's "at most 10 active images"); None: no cap beyond the
        window. Each observation carries one screenshot, so the window of the last
        ``max_screenshots`` observations (the seed's "image groups") shows at most
        ``max_screenshots`` (+ 1 protected) images and the cap binds only when it is smaller;
        when it binds, the window shows the newest ``max_active_images`` (- 1 protected).
      protect_initial_observation: the first observation (with the task instruction and its
        screenshot) stays verbatim in every prompt (the seed's "initial context protected"):
        no compaction replaces it by the action history, its screenshot is always shown
        (outside the window of the last ``max_screenshots``, inside ``max_active_images``),
        its text is never a placeholder. False: it is compacted like any other turn.
      placeholder_old_observations: at every compaction, the observation text (accessibility
        tree, terminal) of the kept turns older than the window (the first turn whose
        screenshot is shown; text-only: the last ``keep_last_observations``) becomes the short
        `OBSERVATION_DROPPED` placeholder, so the prompt does not grow with the episode. False:
        old trees stay verbatim until the budget drops their turns (the former behaviour).
      image_start_token: the media span's opening special token.
      image_pad_token: the media placeholder special token (one per image token).
      image_end_token: the media span's closing special token.
      extra_media_tokens: further special tokens that count as media. Every media token the
        model generates is masked out of the loss (with the rest of its reply, whose context
        changes) and kept in the history as the ids of its text, so that later prompts hold no
        placeholder without an image.
      incremental_routes: ask the server for routed experts only from the first position the
        current segment has no route for (``routed_experts_start_len``), instead of the whole
        prompt every call (same rows, far less transfer and memory on long contexts).
      compaction: the context compaction policy.
    """

    system_prompt: str | None = None
    screen_width: int = 1920
    screen_height: int = 1080
    a11y_max_chars: int = 20000
    a11y_max_tokens: int = 0
    terminal_max_chars: int = 4000
    max_screenshots: int = 3
    screenshots_after_compaction: int | None = 1
    max_active_images: int | None = None
    protect_initial_observation: bool = False
    placeholder_old_observations: bool = True
    image_start_token: str = "<|vision_start|>"
    image_pad_token: str = "<|image_pad|>"
    image_end_token: str = "<|vision_end|>"
    extra_media_tokens: tuple[str, ...] = ("<|video_pad|>",)
    incremental_routes: bool = True
    compaction: CompactionConfig = field(default_factory=CompactionConfig)

    def __post_init__(self) -> None:
        for name in (
            "a11y_max_chars",
            "a11y_max_tokens",
            "terminal_max_chars",
            "max_screenshots",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"AgentConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.screen_width < 1 or self.screen_height < 1:
            raise ConfigError(
                f"AgentConfig.screen_width/screen_height must be >= 1, got "
                f"{self.screen_width}x{self.screen_height}"
            )
        low = self.screenshots_after_compaction
        if low is not None and self.max_screenshots and not 1 <= low <= self.max_screenshots:
            raise ConfigError(
                f"AgentConfig.screenshots_after_compaction must be in [1, max_screenshots = "
                f"{self.max_screenshots}] or None, got {low}"
            )
        if self.max_active_images is not None and self.max_active_images < 1 + int(
            self.protect_initial_observation
        ):
            raise ConfigError(
                f"AgentConfig.max_active_images must leave the window at least one image "
                f"(>= {1 + int(self.protect_initial_observation)} with "
                f"protect_initial_observation={self.protect_initial_observation}), got "
                f"{self.max_active_images}"
            )
        object.__setattr__(self, "extra_media_tokens", tuple(self.extra_media_tokens))

    @property
    def media_tokens(self) -> tuple[str, ...]:
        """Every special token string that counts as media."""
        return (
            self.image_start_token,
            self.image_pad_token,
            self.image_end_token,
            *self.extra_media_tokens,
        )

    @property
    def protected_observations(self) -> int:
        """Leading observations no compaction rewrites: 1 with ``protect_initial_observation``."""
        return int(self.protect_initial_observation)

    @property
    def screenshot_window(self) -> int:
        """Screenshots the window shows at most (``max_screenshots``, within the image cap)."""
        if self.max_active_images is None:
            return self.max_screenshots
        return min(self.max_screenshots, self.max_active_images - self.protected_observations)

    @property
    def screenshot_low_water(self) -> int:
        """Screenshots a ``screenshots`` compaction keeps shown (the new one included)."""
        low = self.screenshots_after_compaction
        window = self.screenshot_window
        return window if low is None else min(low, window)

    def replace(self, **changes: object) -> AgentConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True)
class GroupPolicyConfig:
    """Which prompt groups of a step are trained on, and who forms the baseline.

    Attributes:
      min_healthy_per_group: a group with fewer healthy (non-failed) owners is dropped.
      on_dropped_group: ``shrink`` trains on the remaining groups; ``fail`` fails the step.
      min_step_batch_fraction: the step fails when fewer than this fraction of the step's prompt
        groups survive.
      baseline_population: who forms the group statistics: ``logical_owners`` (the default),
        every logical owner of the group with a known reward, each once; owners masked for an
        infrastructure failure or as stale stay out of every statistic. ``all_owners`` (the
        seed's recipes): every owner of the group, a masked one as a placeholder of reward 0
        and no tokens (`BaselinePopulation`).
    """

    min_healthy_per_group: int = 2
    on_dropped_group: OnDroppedGroup = "shrink"
    min_step_batch_fraction: float = 0.5
    baseline_population: BaselinePopulation = "logical_owners"

    def __post_init__(self) -> None:
        if self.min_healthy_per_group < 1:
            raise ConfigError(
                "GroupPolicyConfig.min_healthy_per_group must be >= 1, got "
                f"{self.min_healthy_per_group}"
            )
        check_choice(self.on_dropped_group, OnDroppedGroup, "GroupPolicyConfig.on_dropped_group")
        retired = _RETIRED_POPULATIONS.get(str(self.baseline_population))
        if retired is not None:
            raise ConfigError(
                f"GroupPolicyConfig.baseline_population = {self.baseline_population!r} is "
                f"retired: {retired}; use 'logical_owners'"
            )
        check_choice(
            self.baseline_population, BaselinePopulation, "GroupPolicyConfig.baseline_population"
        )
        if not 0.0 <= self.min_step_batch_fraction <= 1.0:
            raise ConfigError(
                "GroupPolicyConfig.min_step_batch_fraction must be in [0, 1], got "
                f"{self.min_step_batch_fraction}"
            )
