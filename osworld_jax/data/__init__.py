"""osworld_jax.data: grain pipelines over task sets and the offline DAPO-band freezer."""

from osworld_jax.data.errors import DataError, FreezeError, TaskSetEmptyError
from osworld_jax.data.freeze import freeze_band, read_calibration, task_asset_files
from osworld_jax.data.pipeline import DataConfig, TaskStream, make_task_stream, resolve_task_set
from osworld_jax.data.tasksets import TaskRef, load_task_refs, sha256_file, verify_sha256sums

__all__ = [
    "DataConfig",
    "DataError",
    "FreezeError",
    "TaskRef",
    "TaskSetEmptyError",
    "TaskStream",
    "freeze_band",
    "load_task_refs",
    "make_task_stream",
    "read_calibration",
    "resolve_task_set",
    "sha256_file",
    "task_asset_files",
    "verify_sha256sums",
]
