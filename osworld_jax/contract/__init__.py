"""osworld_jax.contract: what the trainer's client and the servers share (the bottom room).

Errors (``errors.py``), SGLang's routed-experts encoding (``routes.py``), the sampling
constants both sides agree on (``sampling.py``) and the weight-refit protocol (``refit.py``).
numpy only: no jax, and nothing of `osworld_jax.rollout` (the client) or `osworld_jax.server`
(the embedded server), which both import it and never each other.
"""
