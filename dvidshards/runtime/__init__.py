"""The process-level machinery beside the pure formats, installed on import (``import dvidshards``
does it): numba's compiler (`kernels`, ``dvidshards warm``), mapping files once per process and
host (`mappings`), a zstd decompressor per thread (`zstd`), the fork guard (`forks`) and the file
lock between processes (`locks`).
"""

from __future__ import annotations

from . import forks, kernels, locks, mappings, zstd
from .kernels import prepare_for_job

__all__ = ["forks", "kernels", "locks", "mappings", "prepare_for_job", "zstd"]
