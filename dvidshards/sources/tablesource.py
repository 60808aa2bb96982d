"""``TableSource``: block records in a table, read as a ``Dataset`` source.

A table folder written by ``dvidshards ingest`` (``sources.tables`` describes its layout) is
read by file name and the row groups' ``morton`` statistics; any other Parquet or Arrow table
or stream with DVID's record columns (or the prototype's ``block_coord_*`` /
``compressed_data``) is indexed in memory by its chunk coordinates.
"""

from __future__ import annotations

import contextlib
import os
import threading

import numpy as np
import pyarrow as pa

from ..errors import ChunkIndexError, MissingShardError, ShardFormatError, SpecError
from ..formats.chunkindex import pack_keys
from ..formats.multiscale import SINGLE_SHARD, Scale, parse_multiscale
from ..formats.records import RecordTable
from .base import RecordSource
from .tables import (
    BINS,
    as_arrow_table,
    coords_of,
    morton_codes,
    normalise_records,
    read_table_info,
    record_keys,
    shard_ids,
    spec_from,
    table_files,
)

__all__ = ["TableSource"]

_PARQUET = (".parquet", ".parq", ".pq")


@contextlib.contextmanager
def _parquet(path: str):
    try:
        yield
    except (OSError, ValueError, pa.ArrowException) as e:
        raise ShardFormatError(f"{path}: cannot read the Parquet file ({e})") from None


class TableSource(RecordSource):
    """Block records in a table, as a ``Dataset`` source: ``Dataset(TableSource(...))``.

    Parameters
    ----------
    source : path, pyarrow.Table, RecordBatchReader or any object with ``__arrow_c_stream__``
        A table folder written by ``ingest`` (with ``info``), a Parquet file or folder, an
        Arrow IPC/Feather file, or records in memory (streams are read once).
    spec : dict or path, optional
        The records' neuroglancer multiscale spec (default: the table's ``info`` or its
        ``dvidshards.spec`` schema metadata).
    scale : int
        Scale of the records of a plain table (a table folder names its own scales).
    partial : bool
        Read scales of a table folder whose ingest did not finish (absent shards read as missing).
    """

    immediate = True
    mappable = False

    def __init__(self, source, *, spec=None, scale: int = 0, partial: bool = False):
        self._lock = threading.Lock()
        self._meta: dict = {}
        self._ids: dict = {}  # per scale: shard ids per origin, in the table and by the spec
        self.layout: str | None = None
        if not isinstance(source, (str, os.PathLike)):
            self.name = f"<{type(source).__name__}>"
            self._init_memory(as_arrow_table(source), spec, scale)
            return
        path = self.name = os.fspath(source)
        info = read_table_info(path) if os.path.isdir(path) else None
        if info is None:
            self._init_plain(path, spec, scale)
            return
        own = info["dvidshards_table"]
        self._done = {int(k) for k in own.get("scales_done", [])}
        held = own.get("scales_exported")
        self.exported = None if held is None else tuple(sorted(int(k) for k in held))
        self._partial = bool(partial)
        self.layout = path
        self.spec = spec_from(spec, None) or {k: v for k, v in info.items() if k != "dvidshards_table"}
        self.scales = {s.index: s for s in parse_multiscale(self.spec, os.path.join(path, "info"))}
        self._files: dict[int, dict] = {}

    def __getstate__(self):
        d = self.__dict__.copy()
        d["_lock"] = None
        d["_meta"] = {}
        d["_ids"] = {}
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"TableSource({self.name!r})"

    # --- plain tables: indexed in memory by their coordinates ----------------------------------

    def _init_plain(self, path: str, spec, scale: int) -> None:
        import pyarrow.parquet as pq

        if not os.path.exists(path):
            raise SpecError(f"{path}: no such table")
        if not os.path.isdir(path) and not path.lower().endswith(_PARQUET):
            try:
                with pa.memory_map(path) as src:
                    try:
                        t = pa.ipc.open_file(src).read_all()
                    except pa.ArrowInvalid:
                        src.seek(0)
                        t = pa.ipc.open_stream(src).read_all()
            except (pa.ArrowInvalid, OSError) as e:
                raise SpecError(f"{path}: not a Parquet or Arrow IPC table ({e})") from None
            self._init_memory(t, spec, scale)
            return
        files = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(path) for f in fs
                       if not f.startswith((".", "_")) and f.lower().endswith(_PARQUET)) \
            if os.path.isdir(path) else [path]
        if not files:
            raise SpecError(f"{path}: no Parquet files")
        self._pq: list = []
        pieces, coords = [], []
        for fi, f in enumerate(files):
            with _parquet(f):
                pf = pq.ParquetFile(f)
            self._pq.append(f)
            names = pf.schema_arrow.names
            cols = [c for c in ("chunk_x", "chunk_y", "chunk_z", "block_coord_x", "block_coord_y",
                                "block_coord_z") if c in names]
            for g in range(pf.num_row_groups):
                c = coords_of(pf.read_row_group(g, columns=cols), f)
                coords.append(c)
                pieces.append(np.stack([np.full(len(c), fi), np.full(len(c), g), np.arange(len(c))], 1))
            schema = pf.schema_arrow
        self.spec = spec_from(spec, schema)
        self._setup(np.concatenate(coords) if coords else np.zeros((0, 3), np.int64),
                    np.concatenate(pieces) if pieces else np.zeros((0, 3), np.int64), scale)
        self._memory = None

    def _init_memory(self, t: pa.Table, spec, scale: int) -> None:
        self.spec = spec_from(spec, t.schema)
        if self.spec is None:  # before reading coordinates: the missing spec is the first thing to say
            raise SpecError(f"{self.name}: give the neuroglancer multiscale spec of these records (spec=...)")
        self._memory = t
        self._setup(coords_of(t, self.name), None, scale)

    def _setup(self, coords: np.ndarray, where: np.ndarray | None, scale: int) -> None:
        if self.spec is None:
            raise SpecError(f"{self.name}: give the neuroglancer multiscale spec of these records (spec=...)")
        scales = {s.index: s for s in parse_multiscale(self.spec, "spec")}
        if scale not in scales:
            raise SpecError(f"{self.name}: scale {scale} is not in the spec (scales {sorted(scales)})")
        self.scales = scales
        self.scale_index = int(scale)
        s = scales[scale]
        self._where = where
        if len(coords) and coords.min() < 0:
            i = int(np.flatnonzero((coords < 0).any(axis=1))[0])
            raise ChunkIndexError(f"{self.name}: row {i}: negative chunk coordinate {tuple(coords[i])}")
        ext = min(s.shard_extent, SINGLE_SHARD)
        origins = coords * np.asarray(s.chunk_size, np.int64) // ext * ext
        self._rows: dict[tuple, np.ndarray] = {}
        if len(origins):
            order = np.lexsort(origins.T[::-1])
            o = origins[order]
            cut = np.flatnonzero((np.diff(o, axis=0) != 0).any(axis=1)) + 1
            for part in np.split(order, cut):
                self._rows[tuple(int(v) for v in origins[part[0]])] = np.sort(part)

    # --- RecordSource ------------------------------------------------------------------------

    def _layout_files(self, k: int) -> dict:
        assert self.layout is not None  # only table folders (with an info) have layout files
        if k not in self._done and not self._partial:
            raise SpecError(f"{self.layout}: scale {k} was not ingested completely (info: scales_done "
                            f"{sorted(self._done)}); run the ingest again, or open with partial=True")
        f = self._files.get(k)
        if f is None:
            f = self._files[k] = table_files(self.layout, k)
        return f

    def shard_origins(self, scale: Scale) -> list[tuple[int, int, int]]:
        if self.layout is not None:
            return sorted({o for o, _ in self._layout_files(scale.index).values()})
        return sorted(self._rows) if scale.index == self.scale_index else []

    async def load_records(self, scale: Scale, origin) -> RecordTable:
        return self.load_records_sync(scale, origin)

    def load_records_sync(self, scale: Scale, origin) -> RecordTable:
        """The shard's records (MissingShardError when the table has none there)."""
        import pyarrow.parquet as pq

        o = tuple(int(v) for v in origin)
        key = scale.stem(o)
        missing = MissingShardError(f"{self.describe(key)}: the table has no records in this shard")
        if self.layout is None:
            rows = self._rows.get(o) if scale.index == self.scale_index else None
            if rows is None:
                raise missing
            return normalise_records(self._take(rows), self.describe(key), scale)
        files = sorted((s, p) for s, (fo, p) in self._layout_files(scale.index).items() if fo == o)
        if not files:
            raise missing
        parts = []
        for _, p in files:
            with _parquet(p):
                parts.append(pq.ParquetFile(p).read())
        t = parts[0] if len(parts) == 1 else pa.concat_tables(parts)
        return normalise_records(t, files[0][1] if len(files) == 1 else self.describe(key), scale)

    def _take(self, rows: np.ndarray) -> pa.Table:
        if self._memory is not None:
            t = self._memory
            if len(rows) and rows[-1] - rows[0] + 1 == len(rows):
                return t.slice(int(rows[0]), len(rows))  # contiguous (sorted tables): zero-copy
            return t.take(pa.array(rows))
        import pyarrow.parquet as pq

        assert self._where is not None  # Parquet tables are indexed with their row locations
        w = self._where[rows]
        parts = []
        for (fi, g) in sorted({(int(a), int(b)) for a, b in w[:, :2]}):
            sel = w[(w[:, 0] == fi) & (w[:, 1] == g), 2]
            rg = pq.ParquetFile(self._pq[fi]).read_row_group(g)
            parts.append(rg if len(sel) == rg.num_rows else rg.take(pa.array(sel)))
        return pa.concat_tables(parts)

    # --- random access: a batch of chunks by (shard id, morton) -------------------------------

    def _file_meta(self, path: str):
        """(open ParquetFile, its lock, morton min and max per row group, split, columns) of a shard
        file, the 64 most recent kept open: a look-up reads one row group and nothing else.

        ``split[g]`` is False when row group g's ``bin1`` statistics say it is all null (its bins
        are not read); ``columns``: (without bins, with them).
        """
        with self._lock:
            m = self._meta.pop(path, None)
            if m is not None:
                self._meta[path] = m  # most recent last
                return m
        import pyarrow.parquet as pq

        with _parquet(path):
            pf = pq.ParquetFile(path)
            md = pf.metadata
            names = pf.schema_arrow.names
            im = names.index("morton")
            lo = np.full(md.num_row_groups, np.iinfo(np.int64).min, np.int64)
            hi = np.full(md.num_row_groups, np.iinfo(np.int64).max, np.int64)
            ib = names.index("bin1") if "bin1" in names else None
            split = np.full(md.num_row_groups, ib is not None, bool)
            for g in range(md.num_row_groups):
                rg = md.row_group(g)
                st = rg.column(im).statistics
                if st is not None and st.has_min_max:
                    lo[g], hi[g] = st.min, st.max
                if ib is not None:
                    sb = rg.column(ib).statistics
                    split[g] = not (sb is not None and sb.has_null_count and sb.null_count == rg.num_rows)
        cols = [n for n in names if n != "shard_id"]  # the file's name says it
        m = (pf, threading.Lock(), lo, hi, split, ([n for n in cols if n not in BINS], cols))
        with self._lock:
            self._meta[path] = m
            while len(self._meta) > 64:
                self._meta.pop(next(iter(self._meta)))
        return m

    def _origin_ids(self, s: Scale) -> tuple[dict, dict]:
        """({origin: shard ids the table has there}, {origin: shard ids the spec gives there}) (cached)."""
        got = self._ids.get(s.index)
        if got is None:
            at: dict = {}
            for k, (o, _) in self._layout_files(s.index).items():
                at.setdefault(o, set()).add(k)
            got = self._ids[s.index] = (at, {})
        return got

    def read_records(self, scale, chunks) -> RecordTable:
        """The records of a list of chunks (absent ones left out), reading only their row groups."""
        s = scale if isinstance(scale, Scale) else self.scales[int(scale)]
        c = np.asarray(chunks, np.int64).reshape(-1, 3)
        where = self.describe(s.folder)
        if self.layout is None:
            parts = []
            for o in sorted({s.shard_origin(*v) for v in c.tolist()}):
                if o in self._rows and s.index == self.scale_index:
                    t = self.load_records_sync(s, o)
                    rows = np.flatnonzero(np.isin(pack_keys(np.asarray(t.coords, np.int64)), pack_keys(c)))
                    if rows.size:
                        parts.append(t.take(rows))
            return RecordTable.concat(parts, where, s.chunk_size)
        grid = tuple(int(v) for v in s.grid)  # a property that validates: once per call
        c = c[((c >= 0) & (c < np.asarray(grid))).all(axis=1)]
        files = self._layout_files(s.index)
        sid, mor = self._keys(s, c, grid, where)
        pieces = []
        for sh in (np.unique(sid).tolist() if len(sid) > 1 else sid.tolist()):
            if sh not in files:
                continue
            path = files[sh][1]
            pf, lock, lo, hi, split, (plain, cols) = self._file_meta(path)
            want = np.unique(mor[sid == sh]) if len(sid) > 1 else mor
            # row groups of a sorted file hold disjoint, increasing morton ranges
            g = np.searchsorted(hi, want)
            g = np.unique(g[(g < len(hi)) & (lo[np.minimum(g, len(hi) - 1)] <= want)])
            if not len(g):
                continue
            with _parquet(path), lock:  # one reader per open file; small reads run best on this thread
                t = pf.read_row_groups(g.tolist(), columns=cols if split[g].any() else plain, use_threads=False)
            got = t.column("morton").to_numpy()
            if len(got) < 2 or (got[1:] >= got[:-1]).all():
                pos = np.searchsorted(got, want)
                hit = pos[(pos < len(got)) & (got[np.minimum(pos, len(got) - 1)] == want)]
            else:  # not sorted: a table not written by ingest
                hit = np.flatnonzero(np.isin(got, want))
            if len(hit) and hit[-1] - hit[0] + 1 == len(hit):
                pieces.append(t.slice(int(hit[0]), len(hit)))  # one chunk, or a run: zero-copy
            elif len(hit):
                pieces.append(t.take(pa.array(hit)))
        if not pieces:
            return RecordTable.concat([], where, s.chunk_size)
        t = pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces)
        rt = normalise_records(t, where, s, check_keys=False)
        stray = np.flatnonzero(morton_codes(rt.coords, grid).astype(np.int64) != t.column("morton").to_numpy())
        if stray.size:  # a stored key that the spec does not give for its chunk
            raise ChunkIndexError(f"{where}: chunk {tuple(int(v) for v in rt.coords[stray[0]])} is stored under "
                                  f"the key of another chunk: the table was written with another spec")
        return rt

    def _keys(self, s: Scale, c: np.ndarray, grid: tuple, where: str) -> tuple[np.ndarray, np.ndarray]:
        """(shard_id, morton) of in-grid chunks, checked against the shard ids the table holds (a
        DVID shard whose chunks have one shard id, the usual case, takes it without hashing each)."""
        at, expect = self._origin_ids(s)
        mor = morton_codes(c, grid).astype(np.int64)
        ext = min(s.shard_extent, SINGLE_SHARD)
        origins = c * np.asarray(s.chunk_size, np.int64) // ext * ext
        sid = np.empty(len(c), np.int64)
        uo = np.unique(origins, axis=0) if len(c) > 1 else origins
        for o in (tuple(int(v) for v in r) for r in uo):
            ids = expect.get(o)
            if ids is None:
                ids = expect[o] = shard_ids(s, o)
            sel = (origins == o).all(axis=1) if len(uo) > 1 else slice(None)
            sid[sel] = ids[0] if len(ids) == 1 else record_keys(s, c[sel])[0]
            here = at.get(o, set())
            bad = [int(k) for k in np.atleast_1d(sid[sel]) if here and int(k) not in here]
            if bad:  # the spec's shard id is not the one the table used there
                v = c[sel][np.flatnonzero(np.atleast_1d(sid[sel]) == bad[0])[0]]
                raise ChunkIndexError(f"{where}: chunk {tuple(int(x) for x in v)} has shard id {bad[0]} under this "
                                      f"spec, but the table stores its shard as {sorted(here)}: the table was "
                                      f"written with another spec")
        return sid, mor
