"""The process-level machinery beside the pure formats: where and when numba compiles the kernels
(`kernels`, and ``dvidshards warm``), mapping files loaded once per process and host
(`mappings`), a zstd decompressor per thread (`zstd`), the guard against a fork after
TensorStore started (`forks`), and the one file lock between processes (`locks`).

Importing this package installs them: `kernels` as `formats.jit`'s compiler, `mappings` as
`formats.mapping`'s file access, `zstd` as `formats.records`' decompressors, `forks`' fork
hooks. ``import dvidshards`` imports it.
"""

from __future__ import annotations

from . import forks, kernels, locks, mappings, zstd
from .kernels import prepare_for_job

__all__ = ["forks", "kernels", "locks", "mappings", "prepare_for_job", "zstd"]
