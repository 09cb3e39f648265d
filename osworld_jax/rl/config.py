"""Configs of the RL loop and the experiment root that gathers every room's config.

Plain frozen dataclasses (no gin here): ``osworld_jax/config.py`` binds them from gin files at the
edge and passes the built `ExperimentConfig` to `osworld_jax.rl.train`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from osworld_jax.agent.config import AgentConfig, GroupPolicyConfig
from osworld_jax.algorithms import ESTIMATORS
from osworld_jax.contract.refit import RefitPath
from osworld_jax.contract.sampling import GREEDY_EPS, logprob_temperature
from osworld_jax.data import DataConfig
from osworld_jax.env import BACKENDS, AgentEnvConfig
from osworld_jax.env.local import LocalBackendConfig
from osworld_jax.env.osworld_adapter import OSWorldBackendConfig
from osworld_jax.env.remote import RemoteBackendConfig
from osworld_jax.errors import ConfigError
from osworld_jax.model.config import ModelRuntimeConfig, Qwen3MoeConfig
from osworld_jax.registry import check_choice
from osworld_jax.rollout.config import (
    RolloutConfig,
    SamplingParams,
    ServerLauncher,
    SGLangLaunchConfig,
)
from osworld_jax.trainer.config import TrainerConfig
from osworld_jax.trainer.distributed import DistributedConfig

#: The sandbox of a run: a backend's config (the backend is the one whose ``config_class`` it
#: is), or the ``BACKENDS`` name of a backend that takes no config (test backends).
SandboxConfig = LocalBackendConfig | RemoteBackendConfig | OSWorldBackendConfig | str


@dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """The trainer's device mesh: devices per axis (their product is the devices used).

    Presets for 1/2/4/8 GPUs of one host: ``configs/mesh_{1,2,4,8}gpu.gin`` (docs/SCALE.md).

    Attributes:
      data: pure data parallelism (batch rows).
      fsdp: fully sharded data parallelism (batch rows and parameters).
      expert: expert parallelism (experts, and batch rows; tokens go to their experts' devices
        when ``ModelRuntimeConfig.expert_parallel``).
      tensor: tensor parallelism (heads, vocabulary, MLP widths).
      overlap: XLA:GPU flags that overlap the step's collectives with compute
        (`osworld_jax.trainer.overlap.OVERLAP_PRESETS`: "none", "pipelined",
        "collective_matmul"); set in ``XLA_FLAGS`` before the backend starts (flags the user
        set there win).
      device_memory_gib: each device's memory, for the checks made before the devices are seen
        (``scripts/train.py --validate_only`` of a GPU recipe on a laptop); None: only a run
        checks, against what its devices report.
    """

    data: int = 1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1
    overlap: Literal["none", "pipelined", "collective_matmul"] = "none"
    device_memory_gib: float | None = None

    def __post_init__(self) -> None:
        for name, value in self.axes().items():
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"MeshConfig.{name} must be an integer >= 1, got {value!r}")
        if self.device_memory_gib is not None and not self.device_memory_gib > 0:
            raise ConfigError(
                f"MeshConfig.device_memory_gib must be > 0 (or None), got {self.device_memory_gib}"
            )
        from osworld_jax.trainer.overlap import overlap_flags

        overlap_flags(self.overlap)  # an unknown preset raises, naming the choices

    def axes(self) -> dict[str, int]:
        """``{"data": d, "fsdp": f, "expert": e, "tensor": t}`` (``make_mesh`` keywords)."""
        return dict(data=self.data, fsdp=self.fsdp, expert=self.expert, tensor=self.tensor)


@dataclass(frozen=True, kw_only=True)
class RLConfig:
    """The shape and cadence of the RL loop.

    One rollout batch per step, trained in ``TrainerConfig.num_minibatches`` updates; rollouts
    run up to ``max_staleness`` steps ahead.

    The checkpoint cadence is ``CheckpointConfig.save_every`` (every k steps, plus the run's last
    step); the trainer's config holds it so that it is declared once.

    Attributes:
      num_prompts: B, prompt groups (tasks) per step.
      num_owners: N, logical owners (rollouts) per prompt group.
      steps: optimizer steps of the run (``--steps`` overrides).
      estimator: advantage estimator over the logical owners (a name of
        ``osworld_jax.algorithms.ESTIMATORS``).
      seed: seed of the rollout sampling seeds (``fold(seed, step, owner)``; ``None`` leaves
        sampling to the server's randomness).
      max_failed_fraction: the step is bad (skipped, with the infrastructure errors listed: see
        ``max_consecutive_skipped_steps``) when more than this fraction of its owners failed.
      metrics_dir: where ``metrics.jsonl`` and TensorBoard events go, relative to the run dir.
      weights_keep: how many exported HF weight directories (``weights/step_*``) to keep.
      progress_bar: show a tqdm bar with per-stage timing.
      compilation_cache_dir: jax's persistent compilation cache for the trainer and the
        embedded server the run starts (``~`` expanded; an environment's
        ``JAX_COMPILATION_CACHE_DIR`` wins): a restarted or resumed run, and the next run of
        the same shapes, load their programs instead of compiling them again (minutes on a GPU:
        the train step, each prefill bucket of the server). None: no persistent cache.
      success_reward: a healthy owner with reward >= this counts as a pass (``reward/pass_rate``).
      norm_length: the constant L of ``seq-mean-token-sum-norm`` (Dr.GRPO); ``None`` uses the
        generation budget ``max_new_tokens x max_turns``.
      mesh: the trainer's device mesh (default: one device).
      length_buckets: allowed padded row lengths of the device batch (ascending; the smallest
        that fits is used, so few shapes are compiled). Empty: round up to a multiple of 128.
      episode_owners: the first this-many owners of every step write their episode (the
        screenshots each call showed, the replies, reward) under ``<metrics_dir>/episodes/``
        for the analysis notebook; 0 writes none.
      max_staleness: k, how many optimizer steps older than the weights a step trains from its
        tokens may be. 0 is the synchronous loop (rollout -> train -> refit). With k >= 1 the
        rollouts of steps up to ``step + k`` run while step ``step`` trains (asynchronous RL,
        `osworld_jax.rl.producer`); refits reach in-flight requests (the client stitches them,
        each token keeps its weight version).
      stale_owners: what a step does with an owner that has a trainable token from weights more
        than ``max_staleness`` steps old (`stages.check_window`): ``mask`` (the owner is
        failed: a masked row, its group's baseline unchanged) or ``refuse`` (an integrity error
        stops the run).
      max_consecutive_skipped_steps: a bad step (more than ``max_failed_fraction`` of its owners
        failed, or too few groups survive the group policy) is skipped, not fatal: it trains
        nothing, is logged (``steps/skipped``, its cause) and checkpointed, and the task stream
        advances as for any step. Up to this many skipped steps in a row are allowed; one more
        stops the run naming their causes (0: the first bad step stops it).
      extra_rollout_groups: e, groups drawn and rolled out beyond B per step (streaming train).
        Off by default and in every recipe: the step trains the first B groups to finish and
        cancels the rest, so slow (long, often hard) tasks are trained less often than drawn
        (benchmarks/streaming_fairness.py: the slowest quartile 0.62 of the others' share with
        e = 2 over B = 17; benchmarks/NOTES.md).
      min_groups_for_streaming_train: m, the finished groups a step's rollout waits for (None:
        B, every group). m < B has the same bias towards fast groups as e > 0.
      max_buffered_rollouts: with ``max_staleness >= 1``, at most this many groups of started,
        unfinished rollouts at once (a later step launches only within it; None: no cap).
    """

    num_prompts: int = 2
    num_owners: int = 4
    steps: int = 3
    estimator: str = "grpo"
    seed: int | None = 0
    max_failed_fraction: float = 0.5
    metrics_dir: str = "."
    weights_keep: int = 2
    progress_bar: bool = True
    compilation_cache_dir: str | None = None
    success_reward: float = 1.0
    norm_length: int | None = None
    mesh: MeshConfig = field(default_factory=MeshConfig)
    length_buckets: tuple[int, ...] = ()
    episode_owners: int = 1
    max_staleness: int = 0
    stale_owners: Literal["mask", "refuse"] = "mask"
    extra_rollout_groups: int = 0
    min_groups_for_streaming_train: int | None = None
    max_buffered_rollouts: int | None = None
    max_consecutive_skipped_steps: int = 3

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ConfigError(f"RLConfig.max_staleness must be >= 0, got {self.max_staleness}")
        check_choice(self.stale_owners, Literal["mask", "refuse"], "RLConfig.stale_owners")
        if self.max_consecutive_skipped_steps < 0:
            raise ConfigError(
                "RLConfig.max_consecutive_skipped_steps must be >= 0, got "
                f"{self.max_consecutive_skipped_steps}"
            )
        if self.episode_owners < 0:
            raise ConfigError(f"RLConfig.episode_owners must be >= 0, got {self.episode_owners}")
        for name in ("num_prompts", "num_owners", "steps", "weights_keep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"RLConfig.{name} must be >= 1, got {getattr(self, name)}")
        ESTIMATORS.validate(self.estimator, "RLConfig.estimator")
        if not 0.0 <= self.max_failed_fraction <= 1.0:
            raise ConfigError(
                f"RLConfig.max_failed_fraction must be in [0, 1], got {self.max_failed_fraction}"
            )
        if self.norm_length is not None and self.norm_length < 1:
            raise ConfigError(f"RLConfig.norm_length must be >= 1, got {self.norm_length}")
        buckets = tuple(int(b) for b in self.length_buckets)
        if list(buckets) != sorted(set(buckets)) or any(b < 2 for b in buckets):
            raise ConfigError(f"RLConfig.length_buckets must be ascending and >= 2: {buckets}")
        object.__setattr__(self, "length_buckets", buckets)
        self._check_streaming()

    def _check_streaming(self) -> None:
        b, e, m = self.num_prompts, self.extra_rollout_groups, self.min_groups_for_streaming_train
        if e < 0:
            raise ConfigError(f"RLConfig.extra_rollout_groups must be >= 0, got {e}")
        if m is not None and not 1 <= m <= b:
            raise ConfigError(
                f"RLConfig.min_groups_for_streaming_train must be in [1, num_prompts = {b}], "
                f"got {m}"
            )
        cap = self.max_buffered_rollouts
        if cap is not None and cap < b + e:
            raise ConfigError(
                f"RLConfig.max_buffered_rollouts must be >= num_prompts + extra_rollout_groups "
                f"= {b + e} (one step's groups), got {cap}"
            )

    @property
    def rollout_groups(self) -> int:
        """B + e, the groups each step draws and rolls out."""
        return self.num_prompts + self.extra_rollout_groups

    @property
    def min_groups(self) -> int:
        """m, the finished groups a step's rollout waits for (None in the config: B)."""
        m = self.min_groups_for_streaming_train
        return self.num_prompts if m is None else m

    @property
    def streaming(self) -> bool:
        """Whether a step's rollout returns before all its groups finished (e > 0 or m < B)."""
        return self.extra_rollout_groups > 0 or self.min_groups < self.num_prompts

    @property
    def num_logical_owners(self) -> int:
        """B x N, the logical owners of one optimizer step."""
        return self.num_prompts * self.num_owners


@dataclass(frozen=True, kw_only=True)
class ModelSourceConfig:
    """Which HF checkpoint the run starts from.

    Attributes:
      path: an HF checkpoint directory (``config.json``, safetensors, tokenizer): Qwen3-MoE, or
        Qwen3-VL-MoE (e.g. Qwen3-VL-30B-A3B-Instruct; with ``preprocessor_config.json`` the
        agent shows it screenshots), or ``"tiny"``: build a random tiny model with the offline
        tokenizer into ``<run_dir>/base_model`` (``osworld_jax.model.make_tiny_checkpoint``).
      tiny_kind: the tiny model's kind: ``qwen3_moe`` (text) or ``qwen3_vl_moe`` (a tiny ViT
        and Qwen3-VL's processor with a CPU-sized pixel budget: 144 image tokens per 1920x1080
        screenshot).
      tiny_seed: init seed of the tiny model.
      tiny_overrides: ``Qwen3MoeConfig`` keys overriding the tiny model's defaults.
    """

    path: str = "tiny"
    tiny_kind: Literal["qwen3_moe", "qwen3_vl_moe"] = "qwen3_moe"
    tiny_seed: int = 0
    tiny_overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("ModelSourceConfig.path: empty; name an HF checkpoint dir or 'tiny'")
        check_choice(
            self.tiny_kind, Literal["qwen3_moe", "qwen3_vl_moe"], "ModelSourceConfig.tiny_kind"
        )


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """The rollout servers: running ones (``RolloutConfig.urls``), or ones the run starts.

    Attributes:
      launch: ``none`` (use ``RolloutConfig.urls``), ``embedded`` (start ``python -m
        osworld_jax.server.serve`` on the run's model), ``colocated`` (the same server on a
        thread of the trainer's process, sharing its devices: weights move as device arrays,
        `osworld_jax.server.colocated`; one process only) or ``sglang`` (start real SGLang
        servers, ``python -m sglang.launch_server``, configured by ``sglang``); started
        servers replace ``RolloutConfig.urls`` and stop when the run ends (see
        `ServerLauncher`).
      refit: how new weights reach the servers after each step: ``memory`` (the colocated
        server takes the trainer's cast arrays: no file, no host copy), ``disk`` (an HF
        checkpoint under ``<run_dir>/weights`` and ``/update_weights_from_disk``: any server),
        ``auto`` (``memory`` for ``launch = 'colocated'``, else ``disk``).
      host: the started servers' bind address.
      port: the first started server's port (server ``i`` gets ``port + i``; 0: free ports).
      max_running_requests: each started server's concurrent-request cap (its decode batch).
      dtype: the started servers' compute dtype (``--dtype``).
      startup_timeout_s: how long to wait for a started server to serve.
      extra_args: further ``osworld_jax.server.serve`` flags of the embedded server (e.g.
        ``("--context-length", "4096")``); the trainer's ``ModelRuntimeConfig.expert_backend``
        is always passed.
      return_original_logprob: the servers report output logprobs at temperature 1
        (SGLang's ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``, set on the servers the run starts;
        for ``launch = 'none'`` say how the external servers run). See
        `osworld_jax.rollout.logprob_temperature`.
      device_memory_fraction: the embedded server and the trainer share the accelerators: the
        server's share of each device's memory (its ``XLA_PYTHON_CLIENT_MEM_FRACTION``; for
        ``colocated``, the budget its weights and KV cache must fit in the one process); the
        trainer takes ``1 - fraction - SHARE_MARGIN`` (`osworld_jax.rl.servers.memory_shares`).
        Both are checked before anything compiles: the server's weights and KV cache against
        its share, the train step against the trainer's. None: they do not share (jax's
        default of 75% each would not fit twice on one GPU); ignored on the CPU.
      sglang: how ``launch = 'sglang'`` starts SGLang (interpreter, count, parallelism, GPUs).
    """

    launch: ServerLauncher = "none"
    refit: RefitPath = "auto"
    host: str = "127.0.0.1"
    port: int = 0
    max_running_requests: int = 64
    dtype: str = "float32"
    startup_timeout_s: float = 300.0
    extra_args: tuple[str, ...] = ()
    return_original_logprob: bool = False
    device_memory_fraction: float | None = None
    sglang: SGLangLaunchConfig = field(default_factory=SGLangLaunchConfig)

    @property
    def refits_in_memory(self) -> bool:
        """Whether new weights reach the server as device arrays (`refit`, resolved)."""
        return self.launch == "colocated" and self.refit in ("auto", "memory")

    def __post_init__(self) -> None:
        check_choice(self.launch, ServerLauncher, "ServerConfig.launch", "server launcher")
        check_choice(self.refit, RefitPath, "ServerConfig.refit", "refit path")
        if self.refit == "memory" and self.launch != "colocated":
            raise ConfigError(
                "ServerConfig.refit = 'memory' hands the trainer's arrays to a server in its own "
                f"process; launch is {self.launch!r} (use launch = 'colocated', or refit = "
                "'disk' / 'auto')"
            )
        f = self.device_memory_fraction
        if f is not None:
            if self.launch not in ("embedded", "colocated"):
                raise ConfigError(
                    "ServerConfig.device_memory_fraction splits each device between the embedded "
                    f"server and the trainer; launch is {self.launch!r} (use launch = 'embedded' "
                    "or 'colocated', or SGLangLaunchConfig.mem_fraction_static for SGLang)"
                )
            if not 0.02 <= f <= 0.9:
                raise ConfigError(
                    f"ServerConfig.device_memory_fraction must be in [0.02, 0.9], got {f}"
                )
        if not 0 <= self.port < 65536:
            raise ConfigError(f"ServerConfig.port must be in [0, 65536), got {self.port}")
        if self.max_running_requests < 1:
            raise ConfigError(
                f"ServerConfig.max_running_requests must be >= 1, got {self.max_running_requests}"
            )


def scoring_problem(sampling: SamplingParams, server: ServerConfig, gate: str) -> str | None:
    """Why the trainer could not score rollouts of ``sampling`` correctly, or None.

    The trainer scores a token as ``log_softmax(z / T_lp)`` over the whole vocabulary
    (``T_lp = logprob_temperature``), exactly what SGLang reports. That is the behaviour
    policy mu only when nothing else shaped the sampling distribution:

    - penalties and ``min_new_tokens`` change the logits the engine's logprobs are taken from in
      ways that depend on the history: train and rollout logprobs disagree for every gate (its
      importance weights included);
    - with an off-policy gate that compares mu with pi (``binary_kl``, ``ratio``), the reported
      logprobs must also be the distribution the tokens were drawn from: not when top-k / top-p /
      min-p truncate it, when sampling is greedy (SGLang then reports the temperature-1
      logprobs of an argmax policy), or when the servers return the untempered logprobs
      (``return_original_logprob``) of tokens sampled at another temperature.

    Returns:
      One line naming the fields, or None.
    """
    changed = [
        f"{name} = {getattr(sampling, name)}"
        for name, neutral in (
            ("repetition_penalty", 1.0),
            ("frequency_penalty", 0.0),
            ("presence_penalty", 0.0),
            ("min_new_tokens", 0),
        )
        if getattr(sampling, name) != neutral
    ]
    if changed:
        return (
            f"SamplingParams {', '.join(changed)}: the engine's logprobs include history-dependent "
            "logit changes the trainer cannot reproduce, so train and behaviour logprobs disagree; "
            "use the neutral values"
        )
    if gate == "none":
        return None
    why = None
    truncated = [
        f"{name} = {getattr(sampling, name)}"
        for name, neutral in (("top_k", -1), ("top_p", 1.0), ("min_p", 0.0))
        if getattr(sampling, name) != neutral
    ]
    if sampling.temperature < GREEDY_EPS:
        why = (
            "SamplingParams.temperature = 0 samples greedily; the engine reports the "
            "temperature-1 logprobs of an argmax policy"
        )
    elif truncated:
        why = (
            f"SamplingParams {', '.join(truncated)} truncate the sampling distribution; the engine "
            "reports (and the trainer scores) the full-vocabulary logprobs"
        )
    elif server.return_original_logprob and sampling.temperature != 1.0:
        why = (
            f"ServerConfig.return_original_logprob reports temperature-1 logprobs of tokens "
            f"sampled at SamplingParams.temperature = {sampling.temperature}"
        )
    if why is None:
        return None
    return (
        f"LossConfig.gate = {gate!r} compares the behaviour policy with pi, but {why}: use "
        "LossConfig.gate = 'none' or sample from the full tempered distribution"
    )


@dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    """The root of a run's configuration: one config per room, each fact stated once.

    Derived, not configured (see `rollout_for`): the rollout client's R3 switch and route shape
    (``RolloutConfig.return_routed_experts`` = ``TrainerConfig.router_replay``;
    ``num_layers`` / ``num_experts_per_tok`` from the model's ``config.json``), the sandbox
    backend's name (from ``sandbox``), the task-file cache (``sandbox.cache_dir``).

    Attributes:
      model: the starting checkpoint.
      runtime: how the policy computes (expert backend, dtype, remat).
      trainer: the train step, optimizer and checkpointing; ``router_replay`` switches R3 on.
      rollout: the rollout client (server URLs, timeouts, sampling).
      server: the rollout servers: running ones, or embedded / SGLang ones the run starts.
      env: AgentEnv (turns, timeouts, the action space the model's text is parsed in).
      sandbox: the sandbox backend and its settings: ``LocalBackendConfig`` (default),
        ``RemoteBackendConfig`` or ``OSWorldBackendConfig`` (bind e.g.
        ``ExperimentConfig.sandbox = @RemoteBackendConfig()``), or the ``BACKENDS`` name of a
        backend without a config (e.g. ``'memory'``).
      agent: prompting and context compaction.
      group: which prompt groups are trained on and the baseline population.
      data: the task set and its order.
      rl: the loop's shape (B, N, steps, estimator, mesh).
      distributed: how this process joins a multi-host job (process 0 rolls out and broadcasts
        the batch; every process trains, checkpoints and exports).
    """

    model: ModelSourceConfig = field(default_factory=ModelSourceConfig)
    runtime: ModelRuntimeConfig = field(default_factory=ModelRuntimeConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    env: AgentEnvConfig = field(default_factory=AgentEnvConfig)
    sandbox: SandboxConfig = field(default_factory=LocalBackendConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    group: GroupPolicyConfig = field(default_factory=GroupPolicyConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def __post_init__(self) -> None:
        if isinstance(self.sandbox, str):
            BACKENDS.validate(self.sandbox, "ExperimentConfig.sandbox")
        else:
            BACKENDS.name_for_config(self.sandbox)  # raises for a config no backend takes
        problem = scoring_problem(self.rollout.sampling, self.server, self.trainer.loss.gate)
        if problem:
            raise ConfigError(problem)
        need = math.ceil(self.group.min_step_batch_fraction * self.rl.num_prompts - 1e-9)
        if self.rl.min_groups < need:
            raise ConfigError(
                f"RLConfig.min_groups_for_streaming_train = {self.rl.min_groups} may train only "
                f"that many of {self.rl.num_prompts} groups, below the {need} that "
                f"GroupPolicyConfig.min_step_batch_fraction = "
                f"{self.group.min_step_batch_fraction} requires"
            )
        derived = RolloutConfig()
        for name, source in (
            ("return_routed_experts", "TrainerConfig.router_replay"),
            ("num_layers", "the model's config.json"),
            ("num_experts_per_tok", "the model's config.json"),
        ):
            if getattr(self.rollout, name) != getattr(derived, name):
                raise ConfigError(
                    f"RolloutConfig.{name}: the run derives it from {source}; do not set it"
                )

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the behaviour logprobs, hence of every logprob the trainer computes.

        ``rollout.logprob_temperature(SamplingParams.temperature, return_original_logprob=
        ServerConfig.return_original_logprob)``: the sampling temperature, or 1 for greedy
        requests and for servers that return the untempered logprobs.
        """
        return logprob_temperature(
            self.rollout.sampling.temperature,
            return_original_logprob=self.server.return_original_logprob,
        )

    @property
    def backend(self) -> str:
        """The ``BACKENDS`` name of the run's sandbox backend."""
        if isinstance(self.sandbox, str):
            return self.sandbox
        return BACKENDS.name_for_config(self.sandbox)

    @property
    def cache_dir(self) -> str | None:
        """The task-file cache of the sandbox backend (None: the default cache)."""
        return getattr(self.sandbox, "cache_dir", None)

    def rollout_for(self, model: Qwen3MoeConfig) -> RolloutConfig:
        """The rollout client's config for ``model`` (its ``config.json``).

        The client asks for routes exactly when the trainer replays them (R3) and decodes them
        with the model's layer count and top-k.
        """
        replay = self.trainer.router_replay
        return dataclasses.replace(
            self.rollout,
            return_routed_experts=replay,
            num_layers=model.num_hidden_layers if replay else None,
            num_experts_per_tok=model.num_experts_per_tok if replay else None,
        )

    def replace(self, **changes: Any) -> ExperimentConfig:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)
