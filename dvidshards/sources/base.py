"""The record-source interface: block records that do not come as shard files.

A table, an Arrow stream, a Flight server or a VastDB table gives the records of each shard as
a ``RecordTable``; ``dvidshards.shard`` builds the ``Shard`` from them (the records' own chunk
columns are its index), so a ``Dataset`` over a record source reads, bulk-reads, verifies and
converts exactly as over shard files.
"""

from __future__ import annotations

import re

from ..errors import SpecError
from ..formats.multiscale import Scale
from ..formats.records import RecordTable
from ..stores.base import Stat, drive, run_sync

__all__ = ["RecordSource"]


class RecordSource:
    """Block records that do not come as shard files: the interface.

    Implementations give the multiscale ``spec`` (a neuroglancer multiscale dict) and its
    ``scales``, the shard origins holding records, and each shard's records as a ``RecordTable``.
    """

    #: the coroutines complete without waiting (in-memory sources): run them with ``drive``
    immediate = False
    mappable = False
    spec: dict | None = None
    scales: dict[int, Scale]
    name: str = "records"
    #: the scales of ``spec`` the source holds records of (None: every one); the others are "not exported"
    exported: tuple[int, ...] | None = None

    def describe(self, key: str) -> str:
        """A name for messages."""
        return f"{self.name}/{key}" if key else self.name

    def shard_origins(self, scale: Scale) -> list[tuple[int, int, int]]:
        """Voxel origins of the shards that hold records at a scale."""
        raise NotImplementedError

    async def load_records(self, scale: Scale, origin) -> RecordTable:
        """The records of the shard at a voxel origin (MissingShardError when there are none)."""
        raise NotImplementedError

    async def exists(self, key: str) -> bool:
        """Whether ``key`` names a shard of a scale (``s{k}/{ox}_{oy}_{oz}.arrow``) holding records."""
        m = re.fullmatch(r"s([0-9]+)/([0-9]+)_([0-9]+)_([0-9]+)\.arrow", key)
        if not m:
            return False
        k, *o = (int(g) for g in m.groups())
        s = self.scales.get(k)
        return s is not None and tuple(o) in set(self.shard_origins(s))

    async def stat(self, key: str) -> Stat:
        return Stat(None, None)

    def list_sync(self, prefix: str = "") -> list[str]:
        raise SpecError(f"{self.describe(prefix)}: a record source has no folders to list")

    def _sync(self, coro):
        return drive(coro) if self.immediate else run_sync(coro)
