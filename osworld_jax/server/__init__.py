"""osworld_jax.server: the embedded SGLang-compatible JAX server (``python -m ...server.serve``).

The trainer talks to it, as to real SGLang, through `osworld_jax.rollout` (the client side); this
room is what runs behind the HTTP port. Imports run one way: the server uses the contract both
sides share (`osworld_jax.contract`: errors, the routed-experts encoding, sampling constants, the
refit protocol), the model room and the chat template (`osworld_jax.model.chat_template`); it
imports nothing of `osworld_jax.rollout` or `osworld_jax.agent`, and nothing in either imports it
(the RL loop imports only `colocated`, the in-process server's face).

- ``serve.py``: the command line; ``app.py``: the aiohttp app (`build_app`) and SGLang's native
  routes; ``info.py``: the read-only routes; ``openai_api.py`` / ``openai_protocol.py``: the
  OpenAI-compatible routes; ``http_base.py``: what the route modules share (app keys, bodies,
  `Submission`); ``protocol.py``: request validation within `ServerLimits`.
- ``engine.py`` (`Engine`: the scheduler thread, slots, refit), ``runner.py`` (jitted prefill /
  decode over the model's ``forward`` and a slot KV cache), ``sampling.py``, ``prefix_cache.py``,
  ``requests.py`` (`EngineConfig`, `GenRequest`), ``replies.py`` (``/generate`` reply bodies),
  ``images.py`` (``image_data``; jax-free), ``model_files.py`` (tokenizer / processor of a
  checkpoint), ``refit_check.py`` (what a refit may change).

Nothing is imported here, so ``osworld_jax.server.images`` stays jax-free; see
docs/INTERFACES.md.
"""
