"""Block records in a VastDB table: a record source, and a sink that `ingest` writes into.

``VastDBSource`` reads each shard with one ``select`` whose predicate pushes its shard ids and
chunk box down; ``VastDBSink`` inserts one shard per call.  The table's columns are those of
``dvidshards.sources.tables.TABLE_SCHEMA`` (payloads over the 126 KB cell limit split over
``bin1..bin4``).  Needs ``pip install dvidshards[vastdb]`` for a real table; anything with
VastDB's ``select(columns, predicate, config)`` and ``insert(table)`` works.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from ..errors import MissingShardError
from ..formats.multiscale import SINGLE_SHARD, Scale, parse_multiscale
from ..formats.records import RecordTable
from .base import RecordSource
from .tables import (
    CELL_LIMIT,
    TABLE_SCHEMA,
    CellLimitError,
    PartialStreamError,
    as_arrow_table,
    coords_of,
    normalise_records,
    shard_ids,
    split_cells,
)

__all__ = ["Predicate", "VastDBSink", "VastDBSource", "shard_predicate"]


@dataclass(frozen=True)
class Predicate:
    """A pushed-down selection: an AND of per-column conditions (what VastDB can push down).

    ``terms`` maps a column to ``("isin", values)`` or ``("between", lo, hi)`` (inclusive).
    ``to_ibis()`` gives the SDK's form, ``to_pyarrow()`` a ``pyarrow.compute`` expression.
    """

    terms: tuple

    def to_ibis(self):
        from ibis import _

        expr = None
        for col, (op, *args) in self.terms:
            c = getattr(_, col)
            if op == "isin":  # an OR of equalities on one column: what every SDK version pushes down
                e = None
                for v in args[0]:
                    e = (c == int(v)) if e is None else e | (c == int(v))
            else:
                e = (c >= int(args[0])) & (c <= int(args[1]))
            expr = e if expr is None else expr & e
        return expr

    def to_pyarrow(self):
        import pyarrow.compute as pc

        expr = None
        for col, (op, *args) in self.terms:
            f = pc.field(col)
            e = f.isin(list(args[0])) if op == "isin" else (f >= args[0]) & (f <= args[1])
            expr = e if expr is None else expr & e
        return expr


def _pushed(p: Predicate):
    """The predicate as VastDB's SDK takes it: an ibis expression when ibis is installed."""
    try:
        import ibis  # noqa: F401
    except ImportError:
        return p
    return p.to_ibis()


def shard_predicate(scale: Scale, origin) -> Predicate:
    """The predicate selecting one DVID shard's records: its shard ids and its chunk box."""
    lo, hi = scale.shard_box(origin)
    ids = [int(s) for s in shard_ids(scale, origin)]
    return Predicate((("shard_id", ("isin", ids)),
                      ("chunk_x", ("between", int(lo[0]), int(hi[0]) - 1)),
                      ("chunk_y", ("between", int(lo[1]), int(hi[1]) - 1)),
                      ("chunk_z", ("between", int(lo[2]), int(hi[2]) - 1))))


class VastDBSource(RecordSource):
    """Records in a VastDB table (or anything with ``select(columns, predicate, config)``).

    Each shard is one ``select`` with its shard ids and chunk box pushed down.  The spec and
    the shard list are given (VastDB has no listing a reader can trust without a scan):
    ``origins`` maps a scale to its shard origins, default: one ``select`` of the key
    columns.  Needs ``pip install dvidshards[vastdb]`` (which pins ``pyarrow<=23.0.1``) for
    a real table; predicates are ibis expressions when ibis is installed, else `Predicate`.
    """

    immediate = True
    mappable = False

    def __init__(self, table, spec: dict, *, origins: dict | None = None, config=None, name: str = "vastdb"):
        self.table, self.spec, self.config, self.name = table, spec, config, name
        self.scales = {s.index: s for s in parse_multiscale(spec, name)}
        self._origins = dict(origins or {})

    def __getstate__(self):
        raise TypeError("a VastDBSource holds a live table; build it in each worker")

    def shard_origins(self, scale: Scale) -> list[tuple[int, int, int]]:
        if scale.index not in self._origins:
            reader = self.table.select(columns=["chunk_x", "chunk_y", "chunk_z"], predicate=None, config=self.config)
            ext = min(scale.shard_extent, SINGLE_SHARD)
            o = coords_of(reader.read_all()) * np.asarray(scale.chunk_size) // ext * ext
            self._origins[scale.index] = sorted({tuple(int(v) for v in r) for r in o})
        return list(self._origins[scale.index])

    async def load_records(self, scale: Scale, origin) -> RecordTable:
        o = tuple(int(v) for v in origin)
        reader = self.table.select(columns=list(TABLE_SCHEMA.names), predicate=_pushed(shard_predicate(scale, o)),
                                   config=self.config)
        t = reader.read_all() if hasattr(reader, "read_all") else as_arrow_table(reader)
        if not t.num_rows:
            raise MissingShardError(f"{self.describe(scale.stem(o))}: the table has no records in this shard")
        return normalise_records(t, self.describe(scale.stem(o)), scale)


class VastDBSink:
    """Writes shards into a VastDB table with ``table.insert`` (one call per shard).

    A shard already present with the expected row count is skipped (idempotent restarts);
    present with another count is a `PartialStreamError` (delete its rows first).  Label
    lists over the cell limit raise `CellLimitError` (VastDB cells hold 126 KB).
    """

    def __init__(self, table, *, cell_limit: int = CELL_LIMIT, config=None):
        self.table, self.cell_limit, self.config = table, cell_limit, config

    def present(self, shard_id: int) -> int:
        pred = _pushed(Predicate((("shard_id", ("isin", [int(shard_id)])),)))
        return self.table.select(columns=["shard_id"], predicate=pred, config=self.config).read_all().num_rows

    def writer(self, shard_id: int, origin=None) -> _SinkShardWriter:
        """A shard writer with the interface of the Parquet one (used by `ingest_partition`)."""
        return _SinkShardWriter(self, shard_id)

    def write_shard(self, shard_id: int, batches: list[pa.RecordBatch], expected: int) -> int:
        have = self.present(shard_id)
        if have == expected:
            return 0
        if have:
            raise PartialStreamError(f"VastDB table: shard {shard_id} holds {have} rows, {expected} expected; "
                                     f"delete them and ingest again")
        t = pa.Table.from_batches([split_cells(b, self.cell_limit, f"shard {shard_id}") for b in batches],
                                  schema=TABLE_SCHEMA)
        import pyarrow.compute as pc

        for name in ("labels", "supervoxels"):
            n = pc.list_value_length(t.column(name)).to_numpy(zero_copy_only=False) * 8
            big = np.flatnonzero(n > self.cell_limit)
            if big.size:
                i = int(big[0])
                c = tuple(int(t.column(a)[i].as_py()) for a in ("chunk_x", "chunk_y", "chunk_z"))
                raise CellLimitError(f"shard {shard_id}: chunk {c}: its {name} list is {n[i]} bytes, more than "
                                     f"one cell of {self.cell_limit} bytes")
        self.table.insert(t)
        return t.num_rows


class _SinkShardWriter:
    def __init__(self, sink: VastDBSink, shard_id: int):
        self.sink, self.shard_id = sink, int(shard_id)
        self.batches: list[pa.RecordBatch] = []
        self.rows = self.bytes = 0

    def add(self, batch: pa.RecordBatch) -> None:
        self.batches.append(batch)
        self.rows += batch.num_rows
        self.bytes += batch.nbytes

    def close(self) -> None:
        self.sink.write_shard(self.shard_id, self.batches, self.rows)

    def abort(self) -> None:
        self.batches = []
