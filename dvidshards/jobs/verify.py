"""End-to-end checks of an export, shard by shard, in bounded memory, on any store.

Every shard is loaded with the eager policy (remotely: one download per shard), so every
record is checked against its index and its shard's box, and a record that no index row lists
is found.  Every payload is decompressed, which checks its zstd content checksum; with
``decode=True`` every block is also decoded and its label list compared with the record's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..dataset import Dataset, shard_origins
from ..errors import BlockDecodeError, DvidShardsError, MissingShardError, SpecError
from ..formats.codec import block_header, decode_into

__all__ = ["Problem", "VerifyReport", "verify"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an export."""

    path: str
    kind: str  # the error type name
    message: str


@dataclass
class VerifyReport:
    """What ``verify`` checked and found.  ``checked`` is False when there was nothing to check."""

    shards: int = 0
    chunks: int = 0
    decompressed: int = 0
    decoded: int = 0
    problems: list[Problem] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def checked(self) -> bool:
        return self.shards > 0

    @property
    def ok(self) -> bool:
        return self.checked and not self.problems

    def summary(self) -> str:
        head = (f"{self.shards} shards, {self.chunks} chunks, {self.decompressed} payloads decompressed, "
                f"{self.decoded} blocks decoded in {self.seconds:.1f} s: ")
        if self.ok:
            return head + "no problems"
        lines = [head + (f"{len(self.problems)} problems" if self.problems else "nothing was checked")]
        lines += [f"  {p.kind}: {p.message}" for p in self.problems[:50]]
        if len(self.problems) > 50:
            lines.append(f"  ... and {len(self.problems) - 50} more")
        return "\n".join(lines)


def _check_records(shard, report: VerifyReport, decode: bool) -> None:
    """Decompress (and decode) every record; compare its label list with the block's."""
    t = shard.table()
    cs = shard.chunk_size
    out = np.empty(cs[::-1], np.uint64) if decode else None
    for i in range(len(t)):
        try:
            block = t.block(i)
            report.decompressed += 1
            hdr = block_header(block)
            where = t.where(i)
            if hdr.shape != tuple(cs[::-1]):
                report.problems.append(Problem(shard.path, "BlockDecodeError", f"{where}: block is "
                                               f"{hdr.shape[::-1]} voxels (x,y,z), the export's chunks are {cs}"))
                continue
            sv = t.supervoxels(i)
            if len(sv) != hdr.num_labels:
                report.problems.append(Problem(shard.path, "BlockDecodeError", f"{where}: the block has "
                                               f"{hdr.num_labels} labels but its record lists {len(sv)}"))
                continue
            if not np.array_equal(hdr.labels, sv):
                report.problems.append(Problem(shard.path, "ChunkIndexError",
                                               f"{where}: the record's supervoxels differ from the block's label list"))
                continue
            if decode:  # from the block already decompressed: one decompression per record
                try:
                    decode_into(np.frombuffer(block, np.uint8), t.labels(i), out)
                except BlockDecodeError as e:
                    raise BlockDecodeError(f"{where}: {e}") from None
                report.decoded += 1
        except DvidShardsError as e:
            report.problems.append(Problem(shard.path, type(e).__name__, str(e)))


def verify(source, *, scale=None, decode: bool = False, spec=None, progress: bool = False) -> VerifyReport:
    """Check an export: indexes against records, shard placement, payload checksums, and
    (``decode``) every block.

    Parameters
    ----------
    source : path, URL, store or Dataset
        The export.
    scale : int, optional
        Only this scale (folder number; default: all).
    decode : bool
        Also decode every block and check its label lists.
    spec : dict or path, optional
        The export's neuroglancer multiscale spec (see ``Dataset``).
    progress : bool
        Show a progress bar (tqdm) on stderr.

    Returns
    -------
    VerifyReport
        ``report.ok`` is False when a problem was found or nothing was checked.
    """
    from tqdm.auto import tqdm

    t0 = time.monotonic()
    report = VerifyReport()
    try:
        ds = source if isinstance(source, Dataset) else Dataset(source, spec=spec, policy="eager")
        scales = ds.scales if scale is None else [ds.scale(scale)]
        store = ds.store
        try:
            folders = {n for n in store.list_sync("") if n[:1] == "s" and n[1:].isdigit()}
        except SpecError:  # a store that cannot list (http): the spec's scales are all there is
            folders = {s.folder for s in ds.scales}
    except DvidShardsError as e:
        report.problems.append(Problem(str(source), type(e).__name__, str(e)))
        report.seconds = time.monotonic() - t0
        return report
    if scale is None:
        for f in sorted(folders - {s.folder for s in ds.scales}):
            if shard_origins(store, f):
                report.problems.append(Problem(store.describe(f), "SpecError",
                                               f"{store.describe(f)}: holds shards but the spec has no scale {f[1:]}; "
                                               f"they were not checked"))
    for s in scales:
        try:
            origins = ds.shards(s)
            try:
                names = set(store.list_sync(s.folder))
            except SpecError:
                names = set()
        except DvidShardsError as e:
            report.problems.append(Problem(store.describe(s.folder), type(e).__name__, str(e)))
            continue
        for name in sorted(names):  # an index with no shard file beside it
            if name.endswith(".csv") and name[:-4] + ".arrow" not in names:
                w = store.describe(f"{s.folder}/{name}")
                report.problems.append(Problem(w, "MissingShardError", f"{w}: index without its .arrow"))
        grid = np.asarray(s.grid)
        for o in tqdm(origins, desc=f"verify {s.folder}", unit="shard", disable=not progress):
            key = s.stem(o) + ".arrow"
            report.shards += 1
            try:
                if not s.is_origin(o):
                    raise MissingShardError(f"{store.describe(key)}: origin {o} is not a multiple of the shard "
                                            f"extent {s.shard_extent}")
                shard = ds.shard(s, o, policy="eager")
                report.chunks += len(shard)
                beyond = np.flatnonzero((shard.coords >= grid).any(axis=1))
                if len(beyond):
                    c = tuple(int(v) for v in shard.coords[beyond[0]])
                    report.problems.append(Problem(shard.path, "ChunkIndexError",
                                                   f"{shard.path}: chunk {c} lies outside the volume {s.size}"))
                _check_records(shard, report, decode)
                del shard
            except DvidShardsError as e:
                report.problems.append(Problem(store.describe(key), type(e).__name__, str(e)))
    if report.shards == 0 and not report.problems:
        report.problems.append(Problem(store.describe(""), "SpecError",
                                       f"no shard files found under {store.describe('')}"))
    report.seconds = time.monotonic() - t0
    return report

