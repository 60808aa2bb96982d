"""End-to-end checks of an export, shard by shard, in bounded memory, on any store.

Every shard is loaded with the eager policy (remotely: one download per shard), so every
record is checked against its index and its shard's box, and a record that no index row lists
is found.  A shard without its index (no ``.csv`` and no footer) is a problem: DVID always
writes one, so its absence means an incomplete copy (the reader rebuilds it, and says so).
Every payload is decompressed, which checks its zstd content checksum; with ``decode=True``
every block is also decoded and its label list compared with the record's.

The output of ``dvidshards convert`` (a folder holding ``_dvidshards.json``) is checked from its
manifest: the run's state (complete, or the scales and shards done and failed), and with
``spot_check=N`` N random chunks per scale read back through TensorStore and compared with the
source the manifest names.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field

import numpy as np

from ..dataset import Dataset, shard_origins
from ..errors import (
    BlockDecodeError,
    DvidShardsError,
    IndexRebuiltWarning,
    MissingShardError,
    SpecError,
)
from ..formats.codec import block_header, decode_into
from ..shard import not_exported_note
from .output import MANIFEST, read_manifest
from .readback import compare_chunks, kvstore_root, open_scale

__all__ = ["Problem", "VerifyReport", "verify", "verify_conversion"]


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
    #: of ``chunks`` spot-checked against a source: those the source holds none of (must read as 0)
    background: int = 0
    decompressed: int = 0
    decoded: int = 0
    problems: list[Problem] = field(default_factory=list)
    seconds: float = 0.0
    manifest: dict | None = None  # a conversion output's manifest (then shards counts its source shards)
    #: scales the spec lists and the export does not hold (not problems: said under the summary, as ``info`` does)
    not_exported: list[int] = field(default_factory=list)
    #: the export's store, to name it in the line about scales not exported
    store: object = field(default=None, repr=False, compare=False)
    #: lines said under the summary that are not problems (e.g. scales a conversion made, not spot-checked)
    notes: list[str] = field(default_factory=list)

    @property
    def checked(self) -> bool:
        return self.shards > 0

    @property
    def ok(self) -> bool:
        return self.checked and not self.problems

    def summary(self) -> str:
        if self.manifest is not None:
            return self._manifest_summary()
        head = (f"{self.shards} shards, {self.chunks} chunks, {self.decompressed} payloads decompressed, "
                f"{self.decoded} blocks decoded in {self.seconds:.1f} s: ")
        note = [not_exported_note(self.store, self.not_exported)] if self.not_exported and self.store else []
        if self.ok:
            return "\n".join([head + "no problems", *note])
        lines = [head + (f"{len(self.problems)} problems" if self.problems else "nothing was checked")]
        lines += [f"  {p.kind}: {p.message}" for p in self.problems[:50]]
        if len(self.problems) > 50:
            lines.append(f"  ... and {len(self.problems) - 50} more")
        return "\n".join(lines + note)


    def _manifest_summary(self) -> str:
        m = self.manifest or {}
        job = m.get("job", "?")
        params = m.get("parameters") or {}
        src = (m.get("source") or {}).get("url", "?") if isinstance(m.get("source"), dict) else "?"
        what = f"{m.get('format') or params.get('format', '?')} conversion" if job == "convert" else f"{job} output"
        unit = "source shards" if job == "convert" else "tasks"
        scales = m.get("scales") or []
        head = (f"{what} of {src} ({m.get('command') or 'Python API'}): {self.shards} {unit} in {len(scales)} "
                f"scales, manifest says {'complete' if m.get('complete') is True else 'INCOMPLETE'}")
        if self.chunks:
            head += (f"; {self.chunks} chunks compared with the source ({self.chunks - self.background} with data, "
                     f"{self.background} background)")
        lines = [head + (": no problems" if self.ok else f": {len(self.problems)} problems")]
        lines += [f"  {p.kind}: {p.message}" for p in self.problems[:50]]
        if len(self.problems) > 50:
            lines.append(f"  ... and {len(self.problems) - 50} more")
        return "\n".join(lines + self.notes)


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


def _job_manifest(source) -> dict | None:
    """Any job's manifest (``jobs.output.read_manifest``: a folder's, or a one-file output's own
    metadata); None when there is none, or for a downsample's output (an export, verified as one)."""
    m = read_manifest(source)
    return None if m is not None and m.get("job") == "downsample" else m


def verify_conversion(source, *, spot_check: int = 0, seed: int = 0, spec=None) -> VerifyReport | None:
    """Check a job's output from its manifest (``_dvidshards.json``; None: ``source`` holds none).

    Problems: the manifest says incomplete (each failed task named with its reason, the count
    of tasks not done), and for a ``convert`` output with ``spot_check``, chunks that differ from
    the source the manifest names (opened with ``spec`` when given, else the manifest's ``spec``
    member, else the source's own info file), or a source that cannot be opened.  A downsample destination is an export: None (``verify`` checks it as one).
    """
    t0 = time.monotonic()
    if not isinstance(source, (str, os.PathLike, dict)):
        return None
    name = str(source) if isinstance(source, dict) else os.fspath(source)
    where = str(name) if not isinstance(source, dict) and os.path.isfile(name) else f"{name}/{MANIFEST}"
    try:
        m = _job_manifest(source)
        kv = kvstore_root(source)
    except DvidShardsError as e:
        report = VerifyReport(problems=[Problem(where, type(e).__name__, str(e))])
        report.manifest = {}
        return report
    except (ValueError, OSError):  # not a kvstore TensorStore can open: not a job's output
        return None
    if m is None:
        return None
    report = VerifyReport(manifest=m)
    job = m.get("job", "?")
    tasks: dict = m["tasks"] if isinstance(m.get("tasks"), dict) else {}
    failed: dict = m["failed"] if isinstance(m.get("failed"), dict) else {}
    total = int(tasks.get("total", 0))
    report.shards = total
    verb = "was not converted" if job == "convert" else "failed"
    for task, msg in failed.items():
        report.problems.append(Problem(str(task), "TaskFailed", f"{where}: {task} {verb}: {msg}"))
    todo = total - int(tasks.get("done", 0)) - int(tasks.get("kept", 0)) - len(failed)
    if m.get("complete") is not True and todo > 0:
        unit = "source shards not converted" if job == "convert" else f"{job} tasks not done"
        report.problems.append(Problem(where, "Incomplete", f"{where}: {todo} of {total} {unit} (status "
                                       f"{m.get('status', '?')}); run the same command with --resume to finish"))
    if m.get("complete") is not True and not report.problems:
        report.problems.append(Problem(where, "Incomplete", f"{where}: the {job} job did not finish "
                                       f"(status {m.get('status', '?')}, started {m.get('started')})"))
    if spot_check > 0 and job == "convert":
        params = m.get("parameters") or {}
        url = (m.get("source") or {}).get("url") if isinstance(m.get("source"), dict) else None
        fmt = m.get("format") or params.get("format")
        keys = m.get("keys") or {}
        rng = np.random.default_rng(seed)
        try:
            if url is None or fmt is None:
                raise SpecError(f"{where}: the manifest names no source or format")
            ds = Dataset(url, spec=spec if spec is not None else m.get("spec"))
            made = {int(k) for k in m.get("made") or []}
            if made & {int(k) for k in keys}:
                report.notes.append(f"s{', s'.join(str(k) for k in sorted(made))}: made by the conversion (the "
                                    f"source lacks them), not compared with it")
            for k in sorted(keys, key=int):
                if int(k) in made:
                    continue
                arr = open_scale(kv, fmt, keys[k])
                sc = compare_chunks(ds, arr, fmt, int(k), params.get("labels", "agglomerated"), spot_check, rng)
                n, bad = sc
                report.chunks += n
                report.background += getattr(sc, "background", 0)
                report.problems += [Problem(where, "Mismatch", f"{where}: {b}") for b in bad]
        except (DvidShardsError, KeyError, ValueError, IndexError, OSError) as e:  # IndexError: another geometry
            report.problems.append(Problem(where, type(e).__name__, f"{where}: spot check against the source "
                                           f"{url!r} failed: {e}" + ("" if spec is not None or m.get("spec") else
                                                                     " (give the source's spec: --spec)")))
    report.seconds = time.monotonic() - t0
    return report


def verify(source, *, scale=None, decode: bool = False, spec=None, progress: bool = False,
           spot_check: int = 0) -> VerifyReport:
    """Check an export: indexes against records, shard placement, payload checksums, and
    (``decode``) every block.

    Parameters
    ----------
    source : path, URL, store or Dataset
        The export.
    scale : int, optional
        Only this scale (folder number; default: every scale the export holds; the spec's others
        are listed in ``report.not_exported``, not problems).
    decode : bool
        Also decode every block and check its label lists.
    spec : dict or path, optional
        The export's neuroglancer multiscale spec (see ``Dataset``).
    progress : bool
        Show a progress bar (tqdm) on stderr.

    spot_check : int
        For a ``dvidshards convert`` output: chunks per scale to compare with the source (opened
        with ``spec`` when given).

    Returns
    -------
    VerifyReport
        ``report.ok`` is False when a problem was found or nothing was checked.
    """
    from tqdm.auto import tqdm

    t0 = time.monotonic()
    if scale is None:  # a job's output (its manifest says what it holds); ``spec`` is then its source's
        conv = verify_conversion(source, spot_check=spot_check, spec=spec)
        if conv is not None:
            return conv
    report = VerifyReport()
    try:
        ds = source if isinstance(source, Dataset) else Dataset(source, spec=spec, policy="eager")
        if scale is None:  # every scale the export holds; the others are said, as info says them
            scales = [s for s in ds.scales if s.index in ds.exported]
            report.not_exported = [s.index for s in ds.scales if s.index not in ds.exported]
        else:
            scales = [ds.require_scale(scale)]
        store = report.store = ds.store
        try:
            folders = {n for n in store.list_sync("") if n[:1] == "s" and n[1:].isascii() and n[1:].isdigit()}
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
                with warnings.catch_warnings():  # reported below as a problem, not warned about
                    warnings.simplefilter("ignore", IndexRebuiltWarning)
                    shard = ds.shard(s, o, policy="eager")
                report.chunks += len(shard)
                if shard.rebuilt:
                    report.problems.append(Problem(store.describe(key), "MissingShardError",
                                                   f"{store.describe(s.stem(o) + '.csv')}: no chunk index (neither "
                                                   f"the .csv beside {key} nor a CHUNKIDX footer): DVID always "
                                                   f"writes one, so this copy is incomplete (rebuilt from the "
                                                   f"records to check them)"))
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

