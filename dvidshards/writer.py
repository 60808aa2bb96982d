"""Write DVID ``export-shards`` exports exactly as DVID lays them out (FORMATS.md §2-§3).

DVID is the only producer of real exports; this module reproduces its output for tests, the
demo and benchmarks, and writes the older layouts (variants B, C, D) a reader has to accept:
`write_shard` writes one shard from ready-made records, in any variant, in the order given;
`write_export` turns a supervoxel volume into a multi-scale export (64³ blocks in DVID's
encoding, zstd, one folder ``s{k}`` per scale, files named by DVID's cubic shard origin,
records in ZYX order, all-background blocks skipped) and returns the spec DVID was given.

Byte-level facts reproduced (checked against the real mCNS shard in ``shared/data/dvid``):
the record schema (non-nullable fields, ``list<item: uint64>`` with nullable items, field
metadata ``compression=true, codec=zstd`` on ``dvid_compressed_block``); an IPC stream with
continuation markers and the end-of-stream marker ``ff ff ff ff 00 00 00 00``; zstd frames
with content size and checksum (as Go's encoder writes them); the CSV's ``# schema_size=N``
comment, header and ``\\n`` line ends.  ``N`` and the offsets are measured from the bytes
written (pyarrow's schema message is 696 bytes, Go's 688, so offsets differ from DVID's by
that constant).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import struct
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import tensorstore as ts
import zstandard
from tqdm.auto import tqdm

from .errors import SpecError
from .formats.codec import encode_block
from .formats.mapping import LabelMapping
from .formats.sharding import (
    NAMINGS,
    ShardingSpec,
    compressed_z_index_bits,
    dvid_old_shard_extent,
    dvid_shard_extent,
    dvid_shard_origin,
    grid_shape,
    shard_filename_stem,
)

__all__ = ["CHUNK_SIZE", "D_FOOTER_MAGIC", "RECORD_SCHEMA", "RECORD_SCHEMA_NO_UNCOMPRESSED_SIZE", "default_sharding",
           "record_schema", "write_export", "write_shard"]

CHUNK_SIZE = 64  # DVID label blocks (and export chunks) are 64³ voxels
D_FOOTER_MAGIC = b"CHUNKIDX"  # variant D: [JSON index][u64 LE length][b"CHUNKIDX"]
_FILE_MAGIC_LEN = 8  # IPC file format: b"ARROW1" + 2 bytes padding before the schema message
_INDEXES = ("A", "B", "C", "D")
_CONTAINERS = ("stream", "file")
_SCALE_DIR = re.compile(r"s[0-9]+")
_TMP_DIR = re.compile(r"\.dvidshards-write-[0-9]+-[0-9a-f]+\.tmp")  # write_export's work folder


def record_schema(with_uncompressed_size: bool = True) -> pa.Schema:
    """The Arrow schema of an export record as DVID writes it (FORMATS.md §2).

    Non-nullable ``chunk_x, chunk_y, chunk_z`` (int32), ``labels`` and ``supervoxels``
    (list<uint64>), ``dvid_compressed_block`` (binary, field metadata ``compression=true,
    codec=zstd``) and, unless ``with_uncompressed_size`` is False (variant D), ``uncompressed_size``
    (uint32).
    """
    fields = [pa.field(f"chunk_{a}", pa.int32(), nullable=False) for a in "xyz"]
    fields += [pa.field(n, pa.list_(pa.uint64()), nullable=False) for n in ("labels", "supervoxels")]
    fields.append(pa.field("dvid_compressed_block", pa.binary(), nullable=False,
                           metadata={"compression": "true", "codec": "zstd"}))
    if with_uncompressed_size:
        fields.append(pa.field("uncompressed_size", pa.uint32(), nullable=False))
    return pa.schema(fields)


RECORD_SCHEMA = record_schema(True)
RECORD_SCHEMA_NO_UNCOMPRESSED_SIZE = record_schema(False)


# --- one shard ------------------------------------------------------------------------------------


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise SpecError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def _check_layout(index: str, container: str, batch_size: int) -> str:
    """Validate the index/container/batch-size combination; return the container to use."""
    if index not in _INDEXES:
        raise SpecError(f"index must be one of {', '.join(_INDEXES)}, got {index!r}")
    if container not in _CONTAINERS:
        raise SpecError(f"container must be 'stream' or 'file', got {container!r}")
    _positive_int(batch_size, "batch_size")
    if index == "B" and batch_size != 1:
        raise SpecError("index variant B has one record per batch: batch_size must be 1")
    if index in ("A", "B") and container != "stream":
        raise SpecError(f"index variant {index} indexes an IPC stream: container must be 'stream'")
    return "file" if index == "D" else container


def _int32(value: Any, what: str) -> int:
    v = int(value)
    if not -(2**31) <= v < 2**31:
        raise SpecError(f"{what} {v} does not fit in int32")
    return v


def _tmp_name(path: Path) -> Path:
    """A hidden temporary name beside path (no reader takes ``.name.arrow.<pid>.tmp`` for a shard)."""
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def _unlink(path: Path | None) -> None:
    if path is not None:
        path.unlink(missing_ok=True)


class _DvidShardWriter:
    """One shard's .arrow file, written record by record, and its index, written on `close`.

    Rows are buffered until ``batch_size`` of them form a record batch; each batch message's
    byte range is the file position around its write.  Both files are written under hidden
    temporary names and renamed into place when complete, so a refused or interrupted write
    leaves nothing a reader would take for a shard.
    """

    def __init__(self, path_stem: str | os.PathLike, *, batch_size: int, index: str, container: str,
                 with_uncompressed_size: bool, chunk_size: int = CHUNK_SIZE) -> None:
        self.container = _check_layout(index, container, batch_size)
        self.index = index
        self.batch_size = int(batch_size)
        self.chunk_size = int(chunk_size)
        self.schema = record_schema(with_uncompressed_size)
        stem = os.fspath(path_stem)
        self.arrow_path = Path(stem + ".arrow")
        self.index_path = None if index == "D" else Path(stem + ".csv")
        self._base = _FILE_MAGIC_LEN if self.container == "file" else 0
        self._tmp_arrow = _tmp_name(self.arrow_path)
        self._tmp_index: Path | None = None
        self.arrow_path.parent.mkdir(parents=True, exist_ok=True)  # a shard's scale folder, made as needed
        self._sink = pa.OSFile(str(self._tmp_arrow), "wb")
        try:
            opener = pa.ipc.new_file if self.container == "file" else pa.ipc.new_stream
            self._writer = opener(self._sink, self.schema)
        except BaseException:
            self._sink.close()
            _unlink(self._tmp_arrow)
            raise
        self._pending: list[Mapping[str, Any]] = []
        self.schema_size: int | None = None
        self.entries: list[dict[str, int]] = []
        self.num_batches = 0
        self._closed = False

    def add(self, record: Mapping[str, Any]) -> None:
        """Queue one record; writes a batch once ``batch_size`` records are queued."""
        self._pending.append(record)
        if len(self._pending) >= self.batch_size:
            self._flush()

    def _batch(self, rows: Sequence[Mapping[str, Any]]) -> pa.RecordBatch:
        try:
            return self._make_batch(rows)
        except SpecError:
            raise
        except KeyError as e:
            raise SpecError(f"record {len(self.entries)}+: lacks {e}") from None
        except (TypeError, ValueError, OverflowError, pa.ArrowException) as e:
            raise SpecError(f"record {len(self.entries)}+ does not fit the record schema: {e}") from None

    def _make_batch(self, rows: Sequence[Mapping[str, Any]]) -> pa.RecordBatch:
        arrays = [pa.array(np.array([_int32(r[k], k) for r in rows], np.int32), pa.int32())
                  for k in ("chunk_x", "chunk_y", "chunk_z")]
        for name in ("labels", "supervoxels"):
            lists = [np.asarray(r[name], dtype=np.uint64).reshape(-1) for r in rows]
            offsets = np.zeros(len(lists) + 1, dtype=np.int32)
            np.cumsum([len(v) for v in lists], out=offsets[1:])
            values = np.concatenate(lists) if lists else np.zeros(0, np.uint64)
            arrays.append(pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, pa.uint64())))
        arrays.append(pa.array([bytes(r["dvid_compressed_block"]) for r in rows], pa.binary()))
        if "uncompressed_size" in self.schema.names:
            if any("uncompressed_size" not in r for r in rows):
                raise SpecError("records lack 'uncompressed_size', which this schema requires")
            sizes = np.array([int(r["uncompressed_size"]) for r in rows], dtype=np.int64)
            if sizes.size and (sizes.min() < 0 or sizes.max() >= 2**32):
                raise SpecError("uncompressed_size does not fit in uint32")
            arrays.append(pa.array(sizes.astype(np.uint32), pa.uint32()))
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)

    def _read_schema_size(self) -> int:
        """Length of the schema message written (continuation + length + flatbuffer, no body)."""
        with open(self._tmp_arrow, "rb") as f:
            f.seek(self._base)
            cont, meta_len = struct.unpack("<Ii", f.read(8))
        if cont != 0xFFFFFFFF:
            raise RuntimeError("pyarrow wrote an IPC schema message without a continuation marker")
        return 8 + meta_len

    def _flush(self) -> None:
        if not self._pending:
            return
        rows, self._pending = self._pending, []
        batch = self._batch(rows)
        before = self._sink.tell()
        self._writer.write_batch(batch)
        after = self._sink.tell()
        if self.schema_size is None:  # pyarrow writes magic + schema with the first batch
            self.schema_size = self._read_schema_size()
            start = self._base + self.schema_size
            if before not in (0, start):
                raise RuntimeError(f"unexpected IPC writer position {before} before the first batch")
        else:
            start = before
        first = len(self.entries)
        self.entries.extend({"x": int(r["chunk_x"]), "y": int(r["chunk_y"]), "z": int(r["chunk_z"]), "rec": first + i,
                             "offset": start, "size": after - start, "batch_idx": i} for i, r in enumerate(rows))
        self.num_batches += 1

    def close(self) -> dict[str, Any]:
        """Write the last batch, the end of the IPC data and the chunk index, then put both files
        in place (the index first: an index without its .arrow is no shard)."""
        if self._closed:
            raise RuntimeError("shard writer already closed")
        self._closed = True
        try:
            try:
                self._flush()
                self._writer.close()
                if self.schema_size is None:  # no batch at all: schema written on close
                    self.schema_size = self._read_schema_size()
                if self.index == "D":
                    c = self.chunk_size  # keys in voxel units, as in the variant D design doc
                    keys = {f"{e['x'] * c}_{e['y'] * c}_{e['z'] * c}": e["rec"] for e in self.entries}
                    index_json = json.dumps(keys, separators=(",", ":")).encode()
                    self._sink.write(index_json + struct.pack("<Q", len(index_json)) + D_FOOTER_MAGIC)
            finally:
                self._sink.close()
            if self.index_path is not None:
                self._tmp_index = _tmp_name(self.index_path)
                self._tmp_index.write_text(self._csv(), encoding="ascii", newline="")
                os.replace(self._tmp_index, self.index_path)
            else:
                _unlink(Path(os.fspath(self.arrow_path)[:-len(".arrow")] + ".csv"))  # D: an old CSV would win
            os.replace(self._tmp_arrow, self.arrow_path)
        except BaseException:
            _unlink(self._tmp_arrow)
            _unlink(self._tmp_index)
            raise
        return {"arrow_path": self.arrow_path, "index_path": self.index_path, "schema_size": self.schema_size,
                "num_records": len(self.entries), "num_batches": self.num_batches, "entries": self.entries}

    def abort(self) -> None:
        """Close and remove the temporary files after a failure (nothing is put in place)."""
        if not self._closed:
            self._closed = True
            try:
                self._writer.close()
            except Exception:  # noqa: BLE001 - best effort on an already failing path
                pass
            self._sink.close()
            _unlink(self._tmp_arrow)

    def _csv(self) -> str:
        if self.index == "A":
            head = [f"# schema_size={self.schema_size}", "x,y,z,offset,size,batch_idx"]
        elif self.index == "B":
            head = [f"# schema_size={self.schema_size}", "x,y,z,rec,offset,size"]
        else:
            head = ["x,y,z,rec"]
        cols = head[-1].split(",")
        return "\n".join(head + [",".join(str(e[c]) for c in cols) for e in self.entries]) + "\n"


def write_shard(path_stem: str | os.PathLike, records: Iterable[Mapping[str, Any]], *, batch_size: int = 1,
                index: str = "A", container: str = "stream", with_uncompressed_size: bool | None = None,
                chunk_size: int = CHUNK_SIZE) -> dict[str, Any]:
    """Write one DVID shard file and its chunk index from ready-made records, in the order given,
    ``batch_size`` rows per Arrow record batch (the code that writes every shard of `write_export`).

    Parameters
    ----------
    path_stem : str or os.PathLike
        Path without extension (``export/s0/0_0_0``): writes ``{stem}.arrow`` and, but for
        variant D, ``{stem}.csv`` (for D an old one is removed), under hidden temporary names
        renamed into place when complete: refused records or an interruption leave nothing
        behind (an existing shard untouched).
    records : iterable of mapping
        ``chunk_x, chunk_y, chunk_z``, ``labels``, ``supervoxels``, ``dvid_compressed_block`` and,
        when the schema has it, ``uncompressed_size``; written as given (no consistency checks),
        so corrupted shards can be built too.
    batch_size : int
        Rows per record batch (DVID's default is 1).
    index : {"A", "B", "C", "D"}
        Index variant (FORMATS.md §3). "A": CSV ``# schema_size=N`` then
        ``x,y,z,offset,size,batch_idx``; "B": ``# schema_size=N`` then ``x,y,z,rec,offset,size``
        (``batch_size == 1``); "C": CSV ``x,y,z,rec``; "D": IPC file followed by ``[JSON
        {"x_y_z": rec}][u64 LE length][b"CHUNKIDX"]``, keys in voxels (chunk × ``chunk_size``).
    container : {"stream", "file"}
        Arrow IPC stream (DVID) or file: "file" only with C (D is always a file).
    with_uncompressed_size : bool, optional
        Whether the schema has ``uncompressed_size`` (default: but for variant D).

    Returns
    -------
    dict
        ``arrow_path``, ``index_path`` (None for D), ``schema_size`` (bytes of the schema message
        written), ``num_records``, ``num_batches`` and ``entries``: per record ``x, y, z, rec,
        offset, size, batch_idx`` (offset/size: the byte range of its batch message).  SpecError
        for an unknown or invalid variant/container/batch size, or records that do not fit.
    """
    writer = _DvidShardWriter(path_stem, batch_size=batch_size, index=index, container=container,
                              with_uncompressed_size=index != "D" if with_uncompressed_size is None
                              else with_uncompressed_size, chunk_size=chunk_size)
    try:
        for rec in records:
            writer.add(rec)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


# --- sharding specs -------------------------------------------------------------------------------


def default_sharding(size_voxels: Sequence[int], shard_chunks: int = 32, chunk_size: int = CHUNK_SIZE
                     ) -> ShardingSpec:
    """The sharding spec of DVID exports for a scale with cubic shards of ``shard_chunks`` chunks.

    ``preshift_bits + minishard_bits = 3·log2(shard_chunks)`` (fewer when the chunk grid needs
    fewer compressed-Morton bits: then it is one shard), split like the mCNS spec:
    ``preshift_bits = min(9, that)``, the rest minishard bits; ``shard_bits`` the remaining
    bits of the grid; identity hash, gzip minishard index.  ``shard_chunks=32`` reproduces
    every scale of ``mcns-ng-specs.json``.  SpecError unless ``shard_chunks`` is a power of two.
    """
    if isinstance(shard_chunks, bool) or not isinstance(shard_chunks, (int, np.integer)) or \
            shard_chunks < 1 or shard_chunks & (shard_chunks - 1):
        raise SpecError(f"shard_chunks must be a power of two, got {shard_chunks!r}")
    per_axis = int(shard_chunks).bit_length() - 1
    total = sum(compressed_z_index_bits(grid_shape(size_voxels, chunk_size)))
    low = min(3 * per_axis, total)
    preshift = min(9, low)
    return ShardingSpec(preshift_bits=preshift, minishard_bits=low - preshift, shard_bits=total - low,
                        hash="identity", minishard_index_encoding="gzip")


def _as_spec(value: Any) -> ShardingSpec:
    if isinstance(value, ShardingSpec):
        return value
    if isinstance(value, Mapping):
        d = dict(value)
        d.setdefault("@type", "neuroglancer_uint64_sharded_v1")
        return ShardingSpec.from_json(d)
    raise SpecError(f"sharding must be a ShardingSpec or a JSON dict, got {type(value).__name__}")


def _sharding_json(spec: ShardingSpec) -> dict[str, Any]:
    """The spec's JSON with mCNS's member set (data_encoding only when not raw), sorted."""
    d = spec.to_json()
    if d.get("data_encoding", "raw") == "raw":
        d.pop("data_encoding", None)
    return {k: d[k] for k in sorted(d)}  # "@type" sorts first, as in mcns-ng-specs.json


# --- volume access --------------------------------------------------------------------------------


class _Volume:
    """Piecewise (x, y, z) access to a numpy array or a TensorStore, as uint64."""

    def __init__(self, data: Any) -> None:
        self.store: ts.TensorStore | None = None
        self.array: np.ndarray | None = None
        if isinstance(data, ts.TensorStore):
            store = data
            if store.rank == 4 and store.shape[3] == 1:  # neuroglancer x, y, z, channel
                store = store[..., 0]
            if store.rank != 3:
                raise SpecError(f"volume must be 3-D (x, y, z), got rank {store.rank}")
            self.store = store[ts.d[:].translate_to[0]]
            dtype, shape = np.dtype(store.dtype.numpy_dtype), store.shape
        else:
            arr = np.asarray(data)
            if arr.ndim == 4 and arr.shape[3] == 1:
                arr = arr[..., 0]
            if arr.ndim != 3:
                raise SpecError(f"volume must be 3-D (x, y, z), got shape {arr.shape}")
            self.array = arr
            dtype, shape = arr.dtype, arr.shape
        if dtype.kind not in "ui":
            raise SpecError(f"volume must hold integer labels, got dtype {dtype}")
        self.signed = dtype.kind == "i"
        self.shape = tuple(int(s) for s in shape)
        if min(self.shape) < 1:
            raise SpecError(f"volume must not be empty, got shape {self.shape}")

    def as_tensorstore(self) -> ts.TensorStore:
        if self.store is not None:
            return self.store
        assert self.array is not None
        return ts.array(self.array)  # references the numpy data when it can

    def read(self, lo: Sequence[int], hi: Sequence[int]) -> np.ndarray:
        """Voxels ``[lo, hi)``, indexed [x, y, z], in the volume's own integer type (never negative):
        blocks become uint64 one at a time, so a narrow or mostly empty volume is cheap."""
        box = tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))
        if self.store is not None:
            out = self.store[box].read().result()
        else:
            assert self.array is not None
            out = self.array[box]
        if self.signed and out.size and out.min() < 0:
            raise SpecError("volume holds negative labels")
        return out


def _block_label_list(block: bytes) -> np.ndarray:
    """The block label list (supervoxel ids) of an encoded DVID block."""
    n = struct.unpack_from("<I", block, 12)[0]
    return np.frombuffer(block, dtype="<u8", count=n, offset=16).astype(np.uint64)


def _axis_runs(grid_n: int, axis: int, extent: int) -> list[tuple[int, int, int]]:
    """(origin voxel, first chunk, end chunk) of each shard along one axis."""
    c = np.arange(grid_n, dtype=np.int64)
    origins = dvid_shard_origin(np.stack([c, c, c], axis=1), extent, CHUNK_SIZE)[:, axis]
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, grid_n + 1):
        if i == grid_n or origins[i] != origins[start]:
            runs.append((int(origins[start]), start, i))
            start = i
    return runs


def _prepare_dir(root: Path, overwrite: bool) -> bool:
    """Check that root may receive an export and make it; True when it was made here."""
    if root.exists() or root.is_symlink():
        if not root.is_dir():
            raise FileExistsError(f"{root} exists and is not a directory")
        if not overwrite and any(e for e in root.iterdir() if not _TMP_DIR.fullmatch(e.name)):
            raise FileExistsError(f"{root} is not empty (pass overwrite=True to replace an export)")
        return False
    root.mkdir(parents=True)
    return True


def _put_in_place(root: Path, tmp: Path) -> None:
    """Replace root's export (its ``s<N>`` folders and ``info``) by the complete one in tmp."""
    for entry in list(root.iterdir()):  # only what an export consists of, never outside root
        if entry.name == "info" and (entry.is_file() or entry.is_symlink()):
            entry.unlink()
        elif _SCALE_DIR.fullmatch(entry.name):
            if entry.is_symlink() or not entry.is_dir():
                entry.unlink()
            else:
                shutil.rmtree(entry)
    for entry in sorted(tmp.iterdir(), key=lambda e: e.name != "info"):  # info first, scales after
        os.replace(entry, root / entry.name)


def _shard_runs(size: Sequence[int], spec: ShardingSpec, naming: str = "current") -> list[list[tuple[int, int, int]]]:
    """Per axis, (origin voxel, first chunk, end chunk) of each shard file of a scale under a naming."""
    grid = grid_shape(size, CHUNK_SIZE)
    extent = dvid_old_shard_extent(spec, CHUNK_SIZE) if naming == "old" else dvid_shard_extent(spec, size, CHUNK_SIZE)
    return [_axis_runs(grid[a], a, extent) for a in range(3)]


def _write_scale(vol: _Volume, scale_dir: Path, runs: list[list[tuple[int, int, int]]], mapping: LabelMapping | None,
                 compressor: zstandard.ZstdCompressor, *, batch_size: int, index: str, container: str, done,
                 zero_blocks: bool = False) -> int:
    """Write every shard of one scale; the number of records written.

    ``zero_blocks``: also a record for every all-background block of the grid (DVID before 2026-03-27).
    """
    size = vol.shape
    n_written = 0
    cs = CHUNK_SIZE
    zero = encode_block(np.zeros((cs, cs, cs), np.uint64), subblock_order="sorted") if zero_blocks else b""
    for oz, z0c, z1c in runs[2]:
        for oy, y0c, y1c in runs[1]:
            for ox, x0c, x1c in runs[0]:
                writer: _DvidShardWriter | None = None
                try:
                    for zc in range(z0c, z1c):
                        for yc in range(y0c, y1c):
                            # one row of chunks of this shard: bounded memory
                            row = vol.read((x0c * cs, yc * cs, zc * cs),
                                           (min(x1c * cs, size[0]), min((yc + 1) * cs, size[1]),
                                            min((zc + 1) * cs, size[2])))
                            if not zero_blocks and not row.any():
                                continue
                            row_zyx = row.transpose(2, 1, 0)
                            for xc in range(x0c, x1c):
                                part = row_zyx[:, :, (xc - x0c) * cs:(xc - x0c + 1) * cs]
                                if not part.any():
                                    if not zero_blocks:
                                        continue
                                    encoded = zero  # every all-background block encodes alike
                                else:
                                    block = np.zeros((cs, cs, cs), dtype=np.uint64)  # edge blocks padded with 0
                                    block[:part.shape[0], :part.shape[1], :part.shape[2]] = part
                                    encoded = encode_block(block, subblock_order="sorted")  # as in real exports
                                svs = _block_label_list(encoded)
                                labels = svs.copy() if mapping is None else mapping.palette(svs)
                                if not zero_blocks and not labels.any():  # DVID skips all-background blocks
                                    continue
                                if writer is None:
                                    writer = _DvidShardWriter(scale_dir / shard_filename_stem((ox, oy, oz)),
                                                              batch_size=batch_size, index=index, container=container,
                                                              with_uncompressed_size=index != "D")
                                writer.add({"chunk_x": xc, "chunk_y": yc, "chunk_z": zc, "labels": labels,
                                            "supervoxels": svs, "dvid_compressed_block": compressor.compress(encoded),
                                            "uncompressed_size": len(encoded)})
                                n_written += 1
                except BaseException:
                    if writer is not None:
                        writer.abort()
                    raise
                if writer is not None:
                    writer.close()
                done(1)
    return n_written


def write_export(volume: Any, path: str | os.PathLike, *, mapping: Any = None, scales: int = 1,
                 resolution: Sequence[float] = (8, 8, 8), shard_chunks: int | None = None, sharding: Any = None,
                 batch_size: int = 1, index: str = "A", container: str = "stream", zstd_level: int = 3,
                 info: bool = False, overwrite: bool = False, progress: bool | None = None, naming: str = "current",
                 zero_blocks: bool = False, only_scales: Sequence[int] | None = None) -> dict[str, Any]:
    """Write a supervoxel volume as a DVID ``export-shards`` export; the neuroglancer multiscale spec
    DVID is given (shaped like ``mcns-ng-specs.json``).

    Every scale ``k`` gets a folder ``s{k}`` of ``{ox}_{oy}_{oz}.arrow`` files (+ index), one per
    DVID shard holding data, named by DVID's cubic shard origin.  Each 64³ block (edge blocks
    padded with 0) is encoded in DVID's format, zstd-compressed and written as one record with its
    block label list as ``supervoxels`` and the mapped ids as ``labels``; blocks whose labels are all
    0 get none.  Records are in ZYX order within a shard; the volume is read a row of one shard's
    chunks at a time.  The scales are written into a hidden folder under ``path`` and moved into
    place when complete: a failed or interrupted write leaves no export (an overwritten one intact).

    Parameters
    ----------
    volume : numpy.ndarray or tensorstore.TensorStore
        Supervoxel ids (non-negative integers), indexed ``[x, y, z]`` (a trailing channel axis of
        size 1 is dropped); a TensorStore's origin is voxel (0, 0, 0).
    path : str or os.PathLike
        Export root; created if needed.
    mapping : LabelMapping, dict, pandas.Series, (n, 2) array_like or path, optional
        Supervoxel -> body ids (`LabelMapping.from_any`); absent supervoxels map to themselves.
    scales : int
        Scale ``k+1`` is the 2×2×2 mode downsampling of scale ``k`` (``tensorstore.downsample``).
    resolution : 3 floats
        Voxel size of scale 0 (nm), doubled at every scale.
    shard_chunks : int, optional
        Chunks per shard side (power of two) for `default_sharding`; default 32 (mCNS).
    sharding : ShardingSpec or dict, or one per scale, optional
        Instead of `default_sharding` (not with ``shard_chunks``).
    batch_size, index, container :
        Records per Arrow record batch (DVID's 1; also the spec's ``batch_size``), index variant
        and IPC container of every shard (`write_shard`; default: DVID's today).
    zstd_level : int
        Of ``dvid_compressed_block`` (frames carry content size and checksum).
    info : bool
        Also write the spec to ``{path}/info`` (DVID writes none).
    overwrite : bool
        Allow a non-empty ``path``: its ``s<N>`` folders and ``info`` are replaced once the new
        export is complete; nothing else is touched.
    progress : bool, optional
        A tqdm bar on stderr, a step per shard box: None (default) on a terminal only.
    naming : {"current", "old"}
        DVID's shard-file naming generation (FORMATS.md §3a): ``"current"`` (since 2026-03-21) or
        ``"old"`` (one cube of `dvid_old_shard_extent` voxels per scale, so a neuroglancer shard
        larger than it on some axis is split over several files, as in the real mCNS export).
    zero_blocks : bool
        Also a record for every all-background block, as DVID wrote before 2026-03-27.
    only_scales : sequence of int, optional
        Write only these scale folders (the spec lists every scale): an export holding a prefix
        of its spec's scales (``[0]``: DVID's default since 2026-03-29), or a downsample's coarse scales.

    Raises
    ------
    FileExistsError
        ``path`` is a file, or a non-empty folder without ``overwrite``.
    SpecError
        Invalid options, or a volume that is not 3-D non-negative integer data.
    MappingError
        A mapping `LabelMapping.from_any` refuses.
    """
    container = _check_layout(index, container, batch_size)
    scales = _positive_int(scales, "scales")
    try:
        res = [float(r) for r in resolution]
    except (TypeError, ValueError):
        raise SpecError(f"resolution must be 3 positive numbers, got {resolution!r}") from None
    if len(res) != 3 or not all(0 < r < float("inf") for r in res):
        raise SpecError(f"resolution must be 3 positive numbers, got {resolution!r}")
    if sharding is not None and shard_chunks is not None:
        raise SpecError("give either sharding or shard_chunks, not both")
    if isinstance(zstd_level, bool) or not isinstance(zstd_level, (int, np.integer)) or \
            not -(1 << 17) <= zstd_level <= 22:
        raise SpecError(f"zstd_level must be an integer from -131072 to 22, got {zstd_level!r}")
    if naming not in NAMINGS:
        raise SpecError(f"naming must be one of {', '.join(NAMINGS)}, got {naming!r}")
    written = list(range(scales)) if only_scales is None else sorted({int(k) for k in only_scales})
    if any(not 0 <= k < scales for k in written):
        raise SpecError(f"only_scales must be scale numbers from 0 to {scales - 1}, got {only_scales!r}")
    vols = [_Volume(volume)]
    labels = None if mapping is None else LabelMapping.from_any(mapping)
    if scales > 1:  # lazy mode downsampling, read piecewise later
        store = vols[0].as_tensorstore()
        if np.dtype(store.dtype.numpy_dtype) != np.uint64:
            store = ts.cast(store, ts.uint64)
        for _ in range(1, scales):
            store = ts.downsample(store, [2, 2, 2], "mode")
            vols.append(_Volume(store))
    if sharding is None:
        specs = [default_sharding(v.shape, 32 if shard_chunks is None else shard_chunks) for v in vols]
    elif isinstance(sharding, (list, tuple)):
        if len(sharding) != scales:
            raise SpecError(f"got {len(sharding)} sharding specs for {scales} scales")
        specs = [_as_spec(s) for s in sharding]
    else:
        specs = [_as_spec(sharding)] * scales
    spec_scales = []
    for k, (v, sh) in enumerate(zip(vols, specs, strict=True)):
        scale_res = [r * 2**k for r in res]
        spec_scales.append({"chunk_sizes": [[CHUNK_SIZE] * 3], "compressed_segmentation_block_size": [8, 8, 8],
                            "encoding": "compressed_segmentation", "key": "x".join(f"{r:g}" for r in scale_res),
                            "resolution": scale_res, "sharding": _sharding_json(sh), "size": list(v.shape),
                            "voxel_offset": [0, 0, 0]})
    ng_spec = {"batch_size": int(batch_size), "@type": "neuroglancer_multiscale_volume", "data_type": "uint64",
               "num_channels": 1, "scales": spec_scales, "type": "segmentation"}

    root = Path(path)
    made = _prepare_dir(root, overwrite)
    compressor = zstandard.ZstdCompressor(level=zstd_level, write_checksum=True, write_content_size=True)
    runs = [_shard_runs(v.shape, sh, naming) for v, sh in zip(vols, specs, strict=True)]
    total = sum(len(r[0]) * len(r[1]) * len(r[2]) for k, r in enumerate(runs) if k in written)
    # every scale goes into a hidden work folder first: the export appears only when complete,
    # and an overwritten one is replaced only then
    tmp = root / f".dvidshards-write-{os.getpid()}-{secrets.token_hex(4)}.tmp"
    try:
        tmp.mkdir()
        with tqdm(total=total, desc=f"writing {root.name or root}", unit="shard", file=sys.stderr,
                  disable=None if progress is None else not progress, leave=False) as bar:
            for k, (v, r) in enumerate(zip(vols, runs, strict=True)):
                if k in written:
                    (tmp / f"s{k}").mkdir()
                    _write_scale(v, tmp / f"s{k}", r, labels, compressor, batch_size=batch_size, index=index,
                                 container=container, done=bar.update, zero_blocks=zero_blocks)
        if info:
            (tmp / "info").write_text(json.dumps(ng_spec, indent=2) + "\n", encoding="utf-8")
        _put_in_place(root, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if made and not any(root.iterdir()):
            root.rmdir()  # a failed write into a folder it made leaves no folder
    return ng_spec
