"""Rollout configs: the sampling parameters sent to SGLang and the client's settings."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from osworld_jax.contract.refit import TENSOR_FORMATS, SGLangRefitPath
from osworld_jax.contract.sampling import GREEDY_EPS, logprob_temperature  # noqa: F401 (rl.config)
from osworld_jax.errors import ConfigError
from osworld_jax.registry import check_choice

#: Server-selection policies of `SGLangClient` (names only; the client implements them).
#: How the client picks a server: the healthy one with the fewest requests in flight, or in turn.
LoadBalancer = Literal["least_outstanding", "round_robin"]

#: How the RL loop gets its rollout servers (``ServerConfig.launch``): the running ones at
#: ``RolloutConfig.urls``, ``python -m osworld_jax.server.serve`` (CPU or GPU), the same
#: server on a thread of the trainer's process (``colocated``: weights handed over in
#: memory), or ``python -m sglang.launch_server`` (CUDA GPUs; the sglang extra).
ServerLauncher = Literal["none", "embedded", "colocated", "sglang"]


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """SGLang ``sampling_params``, every key sent explicitly.

    A real server fills omitted keys from the model's ``generation_config.json``, so the client
    never omits one.

    Attributes:
      temperature: softmax temperature; 0 means greedy (SGLang then uses temperature 1 and
        top_k 1, so the returned logprobs are at temperature 1). The returned logprobs are at
        `logprob_temperature` (this temperature, unless greedy or original logprobs).
      top_p: nucleus mass in (0, 1].
      top_k: keep the k most likely tokens; -1 keeps the whole vocabulary.
      min_p: drop tokens whose probability is below ``min_p`` times the top probability.
      max_new_tokens: the most tokens to generate.
      min_new_tokens: EOS / stop tokens are suppressed before this many tokens.
      stop: stop strings (matched on the decoded output).
      stop_token_ids: token ids that stop generation (kept in the output).
      skip_special_tokens: drop special tokens from the decoded ``text``.
      no_stop_trim: keep a matched stop string at the end of ``text``.
      ignore_eos: do not stop at the model's EOS token.
      repetition_penalty: multiplicative penalty on tokens already present (1 = none).
      frequency_penalty: additive penalty per occurrence in the output (0 = none).
      presence_penalty: additive penalty for presence in the output (0 = none).
      sampling_seed: per-request seed (None: the server's own randomness).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 512
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    sampling_seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ConfigError(f"SamplingParams.top_k must be -1 or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ConfigError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if self.max_new_tokens < 0:
            raise ConfigError(f"SamplingParams.max_new_tokens must be >= 0: {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ConfigError(
                f"SamplingParams.min_new_tokens must be in [0, max_new_tokens]: "
                f"{self.min_new_tokens}"
            )
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ConfigError(
                f"SamplingParams.repetition_penalty must be in (0, 2]: {self.repetition_penalty}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ConfigError(
                    f"SamplingParams.{name} must be in [-2, 2]: {getattr(self, name)}"
                )
        # Tuples keep the dataclass hashable; accept lists from gin/JSON.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    def logprob_temperature(self, *, return_original_logprob: bool = False) -> float:
        """The temperature of the logprobs a server returns for these parameters.

        See the module function `logprob_temperature` (the single rule the trainer follows).
        """
        return logprob_temperature(
            self.temperature, return_original_logprob=return_original_logprob
        )

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_wire(self) -> dict[str, Any]:
        """The JSON ``sampling_params`` object, every key explicit."""
        d = dataclasses.asdict(self)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Settings of `SGLangClient`.

    Attributes:
      urls: base URLs of the SGLang (or embedded) servers, e.g. ``http://127.0.0.1:30000``; or
        the single URL of an SGLang router fronting many servers (the router then balances and
        forwards refits; every reply's weight version is still checked; see docs/SCALE.md).
      load_balancer: ``least_outstanding`` or ``round_robin`` (`LoadBalancer`).
      request_timeout_s: wall-clock limit of one ``/generate`` call.
      connect_timeout_s: limit on opening a connection.
      control_timeout_s: limit of one control call (health, pause, flush, model_info).
      refit_timeout_s: limit of ``/update_weights_from_disk`` (loading weights takes a while).
      flush_poll_interval_s: sleep between ``/flush_cache`` polls (400 means "not yet").
      flush_max_wait_s: how long ``/flush_cache`` may keep answering 400 during a refit.
      max_retries: retries of one request on connection errors, timeouts and 5xx.
      backoff_initial_s: first backoff sleep; doubles per retry (with +-25% jitter).
      backoff_max_s: cap of the backoff sleep.
      max_abort_resubmits: resubmissions of an aborted request before `AbortBudgetExceeded`.
      health_check_interval_s: period of the background health probe of every server.
      unavailable_wait_s: how long a request waits for some server to become healthy.
      max_connections: connection-pool size of the client.
      return_logprob: ask for output logprobs (required for RL; validated on every reply).
      return_routed_experts: ask for routed experts (router replay, R3).
      num_layers: the model's ``num_hidden_layers`` (to decode routed experts).
      num_experts_per_tok: the model's top-k (to decode routed experts).
      sampling: default sampling parameters of `SGLangClient.generate`.
    """

    urls: tuple[str, ...] = ("http://127.0.0.1:30000",)
    load_balancer: LoadBalancer = "least_outstanding"
    request_timeout_s: float = 900.0
    connect_timeout_s: float = 10.0
    control_timeout_s: float = 30.0
    refit_timeout_s: float = 900.0
    flush_poll_interval_s: float = 0.2
    flush_max_wait_s: float = 120.0
    max_retries: int = 5
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 20.0
    max_abort_resubmits: int = 4
    health_check_interval_s: float = 5.0
    unavailable_wait_s: float = 60.0
    max_connections: int = 512
    return_logprob: bool = True
    return_routed_experts: bool = False
    num_layers: int | None = None
    num_experts_per_tok: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        urls = (self.urls,) if isinstance(self.urls, str) else tuple(self.urls)
        if not urls:
            raise ConfigError("RolloutConfig.urls: at least one server URL is required")
        for u in urls:
            if not u.startswith(("http://", "https://")):
                raise ConfigError(f"RolloutConfig.urls: {u!r} is not an http(s) URL")
        object.__setattr__(self, "urls", tuple(u.rstrip("/") for u in urls))
        check_choice(self.load_balancer, LoadBalancer, "RolloutConfig.load_balancer")
        for name in (
            "request_timeout_s",
            "connect_timeout_s",
            "control_timeout_s",
            "refit_timeout_s",
            "flush_poll_interval_s",
            "health_check_interval_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"RolloutConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_retries", "max_abort_resubmits"):
            if getattr(self, name) < 0:
                raise ConfigError(f"RolloutConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.return_routed_experts and (not self.num_layers or not self.num_experts_per_tok):
            raise ConfigError(
                "RolloutConfig.return_routed_experts needs num_layers and num_experts_per_tok "
                "(the model's num_hidden_layers and num_experts_per_tok) to decode the routes"
            )


@dataclass(frozen=True, kw_only=True)
class SGLangRefitConfig:
    """How new weights reach real SGLang servers (``ServerConfig.launch = 'sglang'`` or external
    SGLang servers); made by `osworld_jax.trainer.sglang_weights.sglang_weights`.

    Attributes:
      path: ``disk`` (an HF checkpoint directory, ``/update_weights_from_disk``: any server,
        any host; the fallback), ``tensor`` (``/update_weights_from_tensor`` per bucket: the
        bucket's CUDA tensors shared by IPC handle; the server must run on the trainer's host
        and see its GPUs) or ``distributed`` (``/init_weights_update_group`` once per server,
        then ``/update_weights_from_distributed`` per bucket while the trainer, rank 0 of a
        process group with the server's ranks, broadcasts it; any host the group can reach).
        See `SGLangRefitPath`; no path is picked implicitly.
      bucket_bytes: the most bytes of one bucket (one request; verl and slime use ~512 MiB); a
        tensor larger than that is a bucket of its own.
        The extra device memory of a refit is about one bucket per server (``tensor``: the
        copy shared by handle; ``distributed``: none beyond the exported tensors).
      load_format: ``None`` (a list of ``(HF name, tensor)``) or ``"flattened_bucket"`` (one
        flat tensor per bucket plus metadata, SGLang's ``FlattenedTensorBucket``; ``tensor``
        needs ``sglang`` importable in the trainer for its metadata class).
      weight_update_session: wrap the in-memory update in ``/begin_weight_update`` ...
        ``/end_weight_update`` (SGLang builds from mid-2026 on; older ones answer 404). Off by
        default: 0.5.x releases have no such routes.
      master_address: ``distributed``: the trainer's address the servers connect to.
      master_port: ``distributed``: the first server's rendezvous port (server ``i`` gets
        ``master_port + i``); 0: a free port per server.
      backend: ``distributed``: ``nccl`` (GPUs) or ``gloo`` (CPU tensors, tests).
      group_timeout_s: ``distributed``: how long joining the group or one broadcast may wait.
    """  # noqa: D205, D209

    path: SGLangRefitPath = "disk"
    bucket_bytes: int = 512 * 2**20
    load_format: str | None = None
    weight_update_session: bool = False
    master_address: str = "127.0.0.1"
    master_port: int = 0
    backend: Literal["nccl", "gloo"] = "nccl"
    group_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        check_choice(self.path, SGLangRefitPath, "SGLangRefitConfig.path", "refit path")
        check_choice(self.backend, Literal["nccl", "gloo"], "SGLangRefitConfig.backend")
        if self.load_format not in TENSOR_FORMATS:
            raise ConfigError(
                f"SGLangRefitConfig.load_format must be one of {list(TENSOR_FORMATS)}, got "
                f"{self.load_format!r}"
            )
        if self.bucket_bytes < 1:
            raise ConfigError(
                f"SGLangRefitConfig.bucket_bytes must be >= 1, got {self.bucket_bytes}"
            )
        if not 0 <= self.master_port < 65536:
            raise ConfigError(
                f"SGLangRefitConfig.master_port must be in [0, 65536), got {self.master_port}"
            )
        if not self.group_timeout_s > 0:
            raise ConfigError(
                f"SGLangRefitConfig.group_timeout_s must be > 0, got {self.group_timeout_s}"
            )


@dataclass(frozen=True, kw_only=True)
class SGLangLaunchConfig:
    """How the RL loop starts real SGLang servers (``ServerConfig.launch = 'sglang'``).

    Server ``i`` of ``num_servers`` listens on ``ServerConfig.port + i`` (free ports when that
    is 0) and uses GPUs ``base_gpu_id + i * tp_size * dp_size`` onwards; see
    `osworld_jax.rollout.launch.sglang_command` for the exact command line.

    Attributes:
      python: the interpreter that has ``sglang`` installed (``pip install
        'osworld_jax[sglang]'``); empty: this one.
      num_servers: how many servers (the client balances requests over them).
      tp_size: tensor-parallel GPUs per server (``--tp-size``).
      dp_size: data-parallel replicas inside one server (``--dp-size``, passed when > 1).
      ep_size: expert-parallel size (``--ep-size``, passed when > 1).
      base_gpu_id: the first GPU of server 0 (``--base-gpu-id``).
      random_seed: server ``i`` gets ``--random-seed random_seed + i``.
      skip_tokenizer_init: token ids in and out (``--skip-tokenizer-init``, as verl and slime);
        the client then decodes the text itself. ``stop`` strings and ``min_new_tokens`` are
        then unavailable (SGLang refuses them).
      context_length: ``--context-length`` (None: the model's).
      mem_fraction_static: ``--mem-fraction-static`` (None: SGLang's default).
      extra_args: further ``sglang.launch_server`` flags, appended last.
      refit: how new weights reach the SGLang servers (`SGLangRefitConfig`: disk, tensor or
        distributed); it also applies to external SGLang servers (``launch = 'none'``).
    """

    python: str = ""
    num_servers: int = 1
    tp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    base_gpu_id: int = 0
    random_seed: int = 0
    skip_tokenizer_init: bool = True
    context_length: int | None = None
    mem_fraction_static: float | None = None
    extra_args: tuple[str, ...] = ()
    refit: SGLangRefitConfig = field(default_factory=SGLangRefitConfig)

    def __post_init__(self) -> None:
        for name in ("num_servers", "tp_size", "dp_size", "ep_size"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"SGLangLaunchConfig.{name} must be >= 1, got {getattr(self, name)}"
                )
        if self.base_gpu_id < 0:
            raise ConfigError(f"SGLangLaunchConfig.base_gpu_id must be >= 0: {self.base_gpu_id}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ConfigError(
                "SGLangLaunchConfig.mem_fraction_static must be in (0, 1), got "
                f"{self.mem_fraction_static}"
            )
        object.__setattr__(self, "extra_args", tuple(str(a) for a in self.extra_args))
