"""Demos that run the real pipeline in minutes on a CPU (``scripts/demo_learning.py``)."""
