"""Test doubles of the outside world, for tests, benchmarks and notebooks (no jax).

Import the modules directly; this package imports nothing on its own:

- ``memory``: the ``memory`` sandbox backend (an in-process desktop, ``BACKENDS`` name
  ``"memory"``) and the learnable ``word_task`` family;
- ``memory_desktop``: ``MemoryDesktop``, the in-process desktop that speaks the in-VM protocol;
- ``faults``: ``FaultInjectingBackend``, which fails a seeded fraction of any backend's calls;
- ``sandbox_service``: ``FakeSandboxService``, an OpenSandbox-style sandbox service over HTTPS on
  loopback (with ``make_test_pki`` and ``FakeFaults``), for the ``remote`` backend; beside it
  ``pki`` (``make_test_pki``: a throw-away CA) and ``memory_vm_server`` (the in-VM server's HTTP
  routes over a ``MemoryDesktop``);
- ``sglang_server``: ``FakeServer``, a scriptable SGLang HTTP server for the rollout client.
"""
