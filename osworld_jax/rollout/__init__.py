"""osworld_jax.rollout: the trainer's side of any SGLang server (client, wire format, launchers).

`SGLangClient` (``client.py``: generate, abort/resubmit, refit), the reply parsing
(``wire.py``), the configs (``config.py``) and the launchers of real SGLang or the embedded
server as subprocesses (``launch.py``). What both sides share (errors, the routed-experts
encoding, sampling constants, the refit protocol) is the bottom room `osworld_jax.contract`. The
embedded SGLang-compatible JAX server is the `osworld_jax.server` room; nothing here imports it
(``launch.py`` starts it by module name). See docs/INTERFACES.md and ../shared/SGLANG_API.md
(the wire contract).
"""

from osworld_jax.contract.errors import (
    AbortBudgetExceeded,
    EngineError,
    RefitError,
    ReplyValidationError,
    RequestRejected,
    RolloutError,
    ServerUnavailable,
)
from osworld_jax.contract.routes import decode_routed_experts, encode_routed_experts
from osworld_jax.rollout.client import SGLangClient
from osworld_jax.rollout.config import (
    LoadBalancer,
    RolloutConfig,
    SamplingParams,
    ServerLauncher,
    SGLangLaunchConfig,
    SGLangRefitConfig,
    logprob_temperature,
)
from osworld_jax.rollout.launch import (
    EmbeddedServer,
    ServerGroup,
    SGLangServer,
    launch_embedded,
    launch_sglang,
)
from osworld_jax.rollout.state import ServerState
from osworld_jax.rollout.wire import Generation, Reply, parse_reply, stitch

__all__ = [
    "LoadBalancer",
    "ServerLauncher",
    "AbortBudgetExceeded",
    "EmbeddedServer",
    "EngineError",
    "Generation",
    "RefitError",
    "Reply",
    "ReplyValidationError",
    "RequestRejected",
    "RolloutConfig",
    "RolloutError",
    "SGLangClient",
    "SGLangLaunchConfig",
    "SGLangRefitConfig",
    "SGLangServer",
    "SamplingParams",
    "ServerGroup",
    "ServerState",
    "ServerUnavailable",
    "decode_routed_experts",
    "encode_routed_experts",
    "launch_embedded",
    "launch_sglang",
    "logprob_temperature",
    "parse_reply",
    "stitch",
]
