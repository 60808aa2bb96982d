"""End-to-end checks of an export, shard by shard, in bounded memory."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import numpy as np

from .formats.codec import block_header
from .dataset import SINGLE_SHARD, Dataset, open_shard, shard_stems
from .errors import DvidShardsError, MissingShardError
from .shardfile import decode_record

__all__ = ["Problem", "VerifyReport", "verify"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an export."""

    path: str
    kind: str  # the error type name
    message: str


@dataclass
class VerifyReport:
    """What ``verify`` checked and found."""

    shards: int = 0
    chunks: int = 0
    decoded: int = 0
    problems: list[Problem] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        head = (f"{self.shards} shards, {self.chunks} chunks, {self.decoded} blocks decoded in "
                f"{self.seconds:.1f} s: ")
        if self.ok:
            return head + "no problems"
        lines = [head + f"{len(self.problems)} problems"]
        lines += [f"  {p.kind}: {p.message}" for p in self.problems[:50]]
        if len(self.problems) > 50:
            lines.append(f"  ... and {len(self.problems) - 50} more")
        return "\n".join(lines)


class _Progress:
    """A one-line progress bar on stderr (no dependency)."""

    def __init__(self, total: int, label: str, enabled: bool):
        self.total, self.label, self.enabled = total, label, enabled and total > 0
        self.n, self.last = 0, 0.0

    def step(self, problems: int) -> None:
        self.n += 1
        now = time.monotonic()
        if self.enabled and (now - self.last > 0.2 or self.n == self.total):
            self.last = now
            w = 30
            k = w * self.n // self.total
            sys.stderr.write(f"\r{self.label} [{'#' * k}{'.' * (w - k)}] {self.n}/{self.total} shards, "
                             f"{problems} problems")
            if self.n == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def _check_records(sf, report: VerifyReport) -> None:
    """Decode every record of a loaded shard; compare its label list with the record's."""
    out = np.empty(sf.chunk_size[::-1], np.uint64)
    for i in range(len(sf)):
        where = f"{sf.path}: chunk {tuple(int(v) for v in sf.index.coords[i])}"
        try:
            block = sf.block(i)
            sv = sf.supervoxels(i)
            hdr = block_header(block)
            if hdr.shape != tuple(sf.chunk_size[::-1]):
                what = f"block is {hdr.shape[::-1]} voxels (x,y,z), the export's chunks are {sf.chunk_size}"
                report.problems.append(Problem(sf.path, "BlockDecodeError", f"{where}: {what}"))
                continue
            decode_record(block, sf.labels(i), out, where)
            if not np.array_equal(hdr.labels, sv):
                report.problems.append(Problem(sf.path, "ChunkIndexError",
                                               f"{where}: record's supervoxels differ from the block's label list"))
                continue
            report.decoded += 1
        except DvidShardsError as e:
            report.problems.append(Problem(sf.path, type(e).__name__, str(e)))


def verify(source, *, scale=None, decode: bool = False, spec=None, progress: bool = False) -> VerifyReport:
    """Check an export: indexes against records, shard placement, and (``decode``) every block.

    Parameters
    ----------
    source : path, URL or Dataset
        The export.
    scale : int, optional
        Only this scale (default: all).
    decode : bool
        Also decompress and decode every block, checking sizes and label lists.
    spec : dict or path, optional
        The export's neuroglancer multiscale spec (see ``Dataset``).
    progress : bool
        Print a progress bar on stderr.

    Returns
    -------
    VerifyReport
    """
    t0 = time.monotonic()
    report = VerifyReport()
    try:
        ds = source if isinstance(source, Dataset) else Dataset(source, spec=spec)
    except DvidShardsError as e:
        report.problems.append(Problem(str(source), type(e).__name__, str(e)))
        return report
    scales = ds.scales if scale is None else [ds.scale(scale)]
    src = ds.source
    for s in scales:
        names = set(src.list(s.folder))
        origins = shard_stems(src, s.folder)
        for name in sorted(names):  # an index with no shard file beside it
            if name.endswith(".csv") and name[:-4] + ".arrow" not in names:
                report.problems.append(Problem(src.describe(f"{s.folder}/{name}"), "MissingShardError",
                                               f"{src.describe(f'{s.folder}/{name}')}: index without its .arrow"))
        bar = _Progress(len(origins), s.folder, progress)
        for o in origins:
            stem = f"{s.folder}/{o[0]}_{o[1]}_{o[2]}"
            report.shards += 1
            try:
                if s.shard_extent < SINGLE_SHARD and any(v % s.shard_extent for v in o):
                    raise MissingShardError(f"{src.describe(stem + '.arrow')}: origin {o} is not a multiple of "
                                            f"the shard extent {s.shard_extent}")
                sf = open_shard(src, stem, s.chunk_size, box=s.shard_box(o))
                report.chunks += len(sf)
                grid = np.asarray(s.grid)
                beyond = np.flatnonzero((sf.index.coords >= grid).any(axis=1)) if len(sf) else []
                if len(beyond):
                    c = tuple(int(v) for v in sf.index.coords[beyond[0]])
                    report.problems.append(Problem(sf.path, "ChunkIndexError",
                                                   f"{sf.path}: chunk {c} lies outside the volume {s.size}"))
                if decode:
                    _check_records(sf, report)
                del sf
            except DvidShardsError as e:
                report.problems.append(Problem(src.describe(stem + ".arrow"), type(e).__name__, str(e)))
            bar.step(len(report.problems))
    report.seconds = time.monotonic() - t0
    return report

