"""What ``query``, ``bodies`` and ``arrays`` need of a dataset: :class:`DatasetLike`.

Those modules sit below ``dataset.py`` (ARCHITECTURE.md) and are given a ``Dataset``; this
``typing.Protocol`` lets them type it without importing it. ``Dataset`` is one (``dataset.py``
checks it under mypy); anything else with these members (a test double, a view of another
store) is one too.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from .formats.multiscale import Scale
from .read import ChunkReader
from .shard import Shard
from .sources import RecordSource
from .stores import ByteStore

__all__ = ["DatasetLike"]


@runtime_checkable
class DatasetLike(Protocol):
    """An export read through one store: its scales, their shard files, a reader per scale."""

    store: ByteStore | RecordSource
    scales: list[Scale]
    exported: tuple[int, ...]

    def scale(self, which: Any = 0, *, resolution: Any = None) -> Scale:
        """A scale by folder number (or ``resolution=``); SpecError when the spec has none."""

    def shards(self, scale: int | Scale = 0) -> list[tuple[int, int, int]]:
        """Voxel origins of the shard files of a scale."""

    def shard(self, scale: int | Scale, origin: Any, *, policy: str | None = None,
              consolidated: bool = True) -> Shard:
        """The loaded, checked shard at a voxel origin."""

    def reader(self, scale: int | Scale = 0, *, labels: Any = "agglomerated", fill_missing_shards: bool = False,
               max_shards: int = 64) -> ChunkReader:
        """The chunk reader of a scale and label source."""

    def read(self, box: Any, *, scale: int | Scale = 0, labels: Any = "agglomerated", out: np.ndarray | None = None,
             threads: int | None = None, fill_missing_shards: bool = False) -> np.ndarray:
        """A voxel box decoded into an (x, y, z) uint64 array."""
