"""dvidshards: read DVID export-shards segmentation exports as TensorStore volumes.

``dvidshards.open`` / ``Dataset`` read an export (or a pyramid of roots); the whole-export jobs
(``convert``, ``downsample``, ``body_stats``, ``label_index``, ``meshes``, ``skeletons``,
``pcg_edges``, ``ingest``, ``verify``) are here too, imported on first use from ``dvidshards.jobs``.
"""

from __future__ import annotations

from typing import Any

from . import errors, runtime  # noqa: F401 - runtime installs the kernel compiler, the mapping-file cache, the fork guard
from .bodies import Body
from .dataset import Dataset, Scale, open
from .errors import *  # noqa: F403 - every error and warning type
from .formats.codec import BlockHeader, block_header, decode_block, encode_block
from .formats.labels import Agglomerated, Mapped, Supervoxels
from .formats.mapping import LabelMapping
from .query import BodyIndex
from .writer import write_export, write_shard

#: the jobs and their reports, imported on first use (``import dvidshards`` stays as fast as a read needs)
_JOBS = ("JobReport", "VerifyReport", "body_stats", "convert", "downsample", "ingest", "label_index", "meshes",
         "pcg_edges", "skeletons", "verify")

__all__ = [*_JOBS, *errors.__all__, "Agglomerated", "Body", "BodyIndex", "BlockHeader", "Dataset", "LabelMapping",
           "Mapped", "Scale", "Supervoxels", "block_header", "decode_block", "encode_block", "open", "write_export",
           "write_shard"]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _JOBS:
        from . import jobs

        value = getattr(jobs, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dvidshards' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_JOBS})
