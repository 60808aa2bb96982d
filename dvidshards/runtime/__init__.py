"""The process-level machinery beside the pure formats: where and when numba compiles the kernels
(`kernels`, and ``dvidshards warm``), mapping files loaded once per process and host
(`mappings`), and the guard against a fork after TensorStore started (`forks`).

Importing this package installs them: `kernels` as `formats.jit`'s compiler, `mappings` as
`formats.mapping`'s file access, `forks`' fork hooks. ``import dvidshards`` imports it.
"""

from __future__ import annotations

from . import forks, kernels, mappings
from .kernels import prepare_for_job

__all__ = ["forks", "kernels", "mappings", "prepare_for_job"]
