"""A stand-in for the ``sglang`` package in launch tests (``python -m sglang.launch_server``)."""
