"""Check an export, or any job's output, end to end: plan → run_task → reduce on the TaskRunner.

An export: every shard loaded eagerly (remotely: one download each), so every record is checked
against its index and its shard's box, and a shard without its index is a problem (DVID always
writes one: an incomplete copy); every payload decompressed (its zstd checksum) and, with
``decode``, every block decoded and its label list compared with the record's.

A job's output: every manifest in it (at its root and in the folders directly below, e.g.
``OUT/mesh/``; a one-file output's metadata) says whether it is complete and names its failed
tasks; a ``convert`` output's chunks are compared with its source (``spot_check``); a
``downsample`` output is checked as the export it is, and the size of every shard file its scales
were made from compared with its source's now.

What is wrong with the data is a :class:`Problem`; a check that could not run leaves the report
incomplete (``JobError`` unless ``allow_partial``, as for every job).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..dataset import Dataset, shard_origins
from ..errors import (
    BlockDecodeError,
    DvidShardsError,
    IndexRebuiltWarning,
    JobError,
    MissingShardError,
    SpecError,
)
from ..formats.codec import block_header, decode_into
from ..pyramid import (
    LayeredStore,
    downsample_manifest,
    identity_changes,
    shard_sizes,
    source_identity,
)
from ..scalefiles import not_exported_note
from ..stores import ByteStore, as_store
from .downsample import SIZES
from .layouts import scale_boxes
from .options import add_source
from .output import MANIFEST, JobReport, read_manifest
from .readback import compare_chunks, kvstore_root, open_scale
from .runner import TaskRunner

__all__ = ["Problem", "VerifyCommand", "VerifyReport", "VerifyTotals", "plan", "reduce", "run_task", "verify"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an export or an output."""

    path: str
    kind: str  # the error type name
    message: str


@dataclass
class VerifyTotals:
    """What the tasks checked."""

    shards: int = 0
    chunks: int = 0
    background: int = 0  # of the chunks spot-checked: those the source holds none of
    decompressed: int = 0
    decoded: int = 0
    manifests: int = 0

    def add(self, o: VerifyTotals) -> None:
        for k in self.__dict__:
            setattr(self, k, getattr(self, k) + getattr(o, k))

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Checked:
    """One task's result."""

    totals: VerifyTotals = field(default_factory=VerifyTotals)
    problems: list[Problem] = field(default_factory=list)
    heads: list[str] = field(default_factory=list)  # a manifest's line in the summary
    notes: list[str] = field(default_factory=list)


@dataclass
class VerifyReport(JobReport):
    """The :class:`~dvidshards.jobs.output.JobReport` of ``verify``: ``problems`` is what is wrong,
    ``totals`` what was checked, ``manifests`` the job manifests read, ``not_exported`` the scales
    the spec lists and the export does not hold."""

    totals: VerifyTotals = field(default_factory=VerifyTotals)
    problems: list[Problem] = field(default_factory=list)
    manifests: list[dict] = field(default_factory=list)
    not_exported: list[int] = field(default_factory=list)
    heads: list[str] = field(default_factory=list)
    store: Any = field(default=None, repr=False, compare=False)

    shards = property(lambda self: self.totals.shards, doc="Shards checked.")
    chunks = property(lambda self: self.totals.chunks, doc="Chunks checked (or compared with a source).")
    background = property(lambda self: self.totals.background, doc="Of them, background in the source.")
    decompressed = property(lambda self: self.totals.decompressed, doc="Payloads decompressed.")
    decoded = property(lambda self: self.totals.decoded, doc="Blocks decoded.")

    @property
    def checked(self) -> bool:
        """A shard or a job's manifest was checked."""
        return self.totals.shards > 0 or self.totals.manifests > 0

    @property
    def ok(self) -> bool:
        """Everything planned was checked, something was, and nothing is wrong."""
        return self.complete and not self.failed and self.checked and not self.problems

    def summary(self, limit: int = 50) -> str:
        verdict = ("no problems" if self.ok else f"{len(self.problems)} problems" if self.problems
                   else "nothing was checked" if not self.checked else "the check is incomplete")
        lines = list(self.heads)
        if self.totals.shards or not self.heads:
            lines.append(f"{self.shards} shards, {self.chunks} chunks, {self.decompressed} payloads decompressed, "
                         f"{self.decoded} blocks decoded in {self.elapsed:.1f} s")
        elif self.totals.chunks:  # a conversion's spot checks
            lines.append(f"{self.chunks} chunks compared with the source ({self.chunks - self.background} with data, "
                         f"{self.background} background) in {self.elapsed:.1f} s")
        lines[-1] += f": {verdict}"
        lines += [f"  {p.kind}: {p.message}" for p in self.problems[:limit]]
        if len(self.problems) > limit:
            lines.append(f"  ... and {len(self.problems) - limit} more")
        lines += [f"  FAILED {item}: {msg}" for item, msg in list(self.failed.items())[:limit]]
        if self.failed or not self.complete:
            lines.append("  the check is incomplete (the tasks above could not run); fix the cause and run verify "
                         "again")
        if self.not_exported and self.store is not None:
            lines.append(not_exported_note(self.store, self.not_exported))
        return "\n".join(lines + self.notes)

    def to_json(self) -> dict:
        return {**super().to_json(), "problems": [p.__dict__ for p in self.problems]}


# --------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class Found:
    """A problem found while planning (nothing to run: the task returns it)."""

    number: int
    problem: Problem

    def name(self) -> str:
        return self.problem.path

    def run(self) -> Checked:
        return Checked(problems=[self.problem])


@dataclass(frozen=True)
class ShardCheck:
    """One shard of an export: its index, records, payloads (and blocks)."""

    ds: Dataset
    scale: int
    origin: tuple[int, int, int]
    decode: bool

    def name(self) -> str:
        return self.ds.store.describe(self.ds.scale(self.scale).stem(self.origin) + ".arrow")

    def run(self) -> Checked:
        out = Checked()
        s, store = self.ds.scale(self.scale), self.ds.store
        key = s.stem(self.origin) + ".arrow"
        out.totals.shards = 1
        try:
            if not s.is_origin(self.origin):
                raise MissingShardError(f"{store.describe(key)}: origin {self.origin} is not a multiple of the shard "
                                        f"extent {s.shard_extent}")
            with warnings.catch_warnings():  # a problem, not a warning
                warnings.simplefilter("ignore", IndexRebuiltWarning)
                shard = self.ds.shard(s, self.origin, policy="eager")
            out.totals.chunks = len(shard)
            if shard.rebuilt:
                out.problems.append(Problem(store.describe(key), "MissingShardError",
                                            f"{store.describe(s.stem(self.origin) + '.csv')}: no chunk index (neither "
                                            f"the .csv beside {key} nor a CHUNKIDX footer): DVID always writes one, "
                                            f"so this copy is incomplete (rebuilt from the records to check them)"))
            beyond = np.flatnonzero((shard.coords >= np.asarray(s.grid)).any(axis=1))
            if len(beyond):
                c = tuple(int(v) for v in shard.coords[beyond[0]])
                out.problems.append(Problem(shard.path, "ChunkIndexError",
                                            f"{shard.path}: chunk {c} lies outside the volume {s.size}"))
            _check_records(shard, out, self.decode)
        except DvidShardsError as e:
            if isinstance(e, JobError):
                raise
            out.problems.append(Problem(store.describe(key), type(e).__name__, str(e)))
        return out


@dataclass(frozen=True)
class ManifestCheck:
    """A job's manifest: complete, or its failed tasks and the tasks not done."""

    where: str
    manifest: str  # JSON: a task is hashable

    def name(self) -> str:
        return self.where

    def run(self) -> Checked:
        m = json.loads(self.manifest)
        where, job = self.where, m.get("job", "?")
        out = Checked()
        out.totals.manifests = 1
        tasks: dict = m["tasks"] if isinstance(m.get("tasks"), dict) else {}
        failed: dict = m["failed"] if isinstance(m.get("failed"), dict) else {}
        total = int(tasks.get("total", 0))
        src = (m.get("source") or {}).get("url", "?") if isinstance(m.get("source"), dict) else "?"
        what = (f"{m.get('format') or (m.get('parameters') or {}).get('format', '?')} conversion" if job == "convert"
                else f"{job} output")
        unit = "source shards" if job == "convert" else "tasks"
        out.heads.append(f"{what} of {src} ({m.get('command') or 'Python API'}): {total} {unit} in "
                         f"{len(m.get('scales') or [])} scales, manifest says "
                         f"{'complete' if m.get('complete') is True else 'INCOMPLETE'}")
        verb = "was not converted" if job == "convert" else "failed"
        for task, msg in failed.items():
            out.problems.append(Problem(str(task), "TaskFailed", f"{where}: {task} {verb}: {msg}"))
        todo = total - int(tasks.get("done", 0)) - int(tasks.get("kept", 0)) - len(failed)
        if m.get("complete") is not True and todo > 0:
            unit = "source shards not converted" if job == "convert" else f"{job} tasks not done"
            out.problems.append(Problem(where, "Incomplete", f"{where}: {todo} of {total} {unit} (status "
                                        f"{m.get('status', '?')}); run the same command with --resume to finish"))
        if m.get("complete") is not True and not out.problems:
            out.problems.append(Problem(where, "Incomplete", f"{where}: the {job} job did not finish "
                                        f"(status {m.get('status', '?')}, started {m.get('started')})"))
        return out


@dataclass(frozen=True)
class SpotCheck:
    """Random chunks of one scale of a conversion compared with its source."""

    where: str
    source: str
    spec: Any  # the source's spec (JSON), or None for its own info file
    root: str  # the output's kvstore spec (JSON)
    fmt: str
    key: str
    scale: int
    labels: Any
    n: int
    seed: int
    box: Any = None  # a boxed conversion's box (scale-0 voxels)

    def name(self) -> str:
        return f"{self.where}: s{self.scale} spot check"

    def run(self) -> Checked:
        out = Checked()
        try:
            ds = Dataset(self.source, spec=None if self.spec is None else json.loads(self.spec))
            arr = open_scale(json.loads(self.root), self.fmt, self.key)
            box = None if self.box is None else scale_boxes(ds, self.box, [self.scale])[self.scale]
            sc = compare_chunks(ds, arr, self.fmt, self.scale, self.labels, self.n,
                                np.random.default_rng([self.seed, self.scale]), box=box)
        except (DvidShardsError, KeyError, ValueError, IndexError, OSError) as e:  # IndexError: another geometry
            out.problems.append(Problem(self.where, type(e).__name__, f"{self.where}: spot check against the source "
                                        f"{self.source!r} failed: {e}" + ("" if self.spec is not None else
                                                                          " (give the source's spec: --spec)")))
            return out
        out.totals.chunks, out.totals.background = sc.compared, sc.background
        out.problems += [Problem(self.where, "Mismatch", f"{self.where}: {b}") for b in sc.problems]
        return out


@dataclass(frozen=True)
class SourceCheck:
    """A downsample output's source: the size of every shard file its scales were made from."""

    output: ByteStore
    source: ByteStore

    def name(self) -> str:
        return f"{self.output.describe('')}: its source"

    def run(self) -> Checked:
        m = downsample_manifest(self.output)
        ident = None if m is None else m["source"].get("identity")
        if ident is None:
            return Checked()
        info = self.output.get_sync("info")  # the spec the scales were made with
        ds = Dataset(self.source, spec=None if info is None else json.loads(info))
        scale = ds.scale(int(ident["scale"]))
        sizes = shard_sizes(self.source, scale, ds.shards(scale))
        why = identity_changes(self.source, ident, source_identity(scale.index, sizes))
        if why is None:
            return Checked()
        raw = self.output.get_sync(SIZES)
        before = json.loads(raw) if raw is not None else {}
        changed = sorted(k for k in set(before) | set(sizes) if before and before.get(k) != sizes.get(k))
        if changed:
            why += f"; the files that differ: {', '.join(changed[:5])}" + (" ..." if len(changed) > 5 else "")
        where = self.output.describe("")
        return Checked(problems=[Problem(where, "SourceChanged",
                                         f"{where}: its scales were made from {self.source.describe('')} as it was "
                                         f"then, and it has changed since ({why}); make them again with "
                                         f"dvidshards downsample --overwrite")])


Task = Found | ShardCheck | ManifestCheck | SpotCheck | SourceCheck


def _check_records(shard: Any, out: Checked, decode: bool) -> None:
    """Decompress (and decode) every record; compare its label list with the block's."""
    t = shard.table()
    cs = shard.chunk_size
    buf = np.empty(cs[::-1], np.uint64)
    for i in range(len(t)):
        try:
            block = t.block(i)
            out.totals.decompressed += 1
            hdr = block_header(block)
            where = t.where(i)
            if hdr.shape != tuple(cs[::-1]):
                out.problems.append(Problem(shard.path, "BlockDecodeError", f"{where}: block is {hdr.shape[::-1]} "
                                            f"voxels (x,y,z), the export's chunks are {cs}"))
                continue
            sv = t.supervoxels(i)
            if len(sv) != hdr.num_labels:
                out.problems.append(Problem(shard.path, "BlockDecodeError", f"{where}: the block has "
                                            f"{hdr.num_labels} labels but its record lists {len(sv)}"))
                continue
            if not np.array_equal(hdr.labels, sv):
                out.problems.append(Problem(shard.path, "ChunkIndexError",
                                            f"{where}: the record's supervoxels differ from the block's label list"))
                continue
            if decode:  # from the block already decompressed: one decompression per record
                try:
                    decode_into(np.frombuffer(block, np.uint8), t.labels(i), buf)
                except BlockDecodeError as e:
                    raise BlockDecodeError(f"{where}: {e}") from None
                out.totals.decoded += 1
        except DvidShardsError as e:
            out.problems.append(Problem(shard.path, type(e).__name__, str(e)))


# --------------------------------------------------------------------------- plan


def _manifests(source: Any) -> Iterator[tuple[str, dict, bool]]:
    """(where, manifest, at the root) of every job manifest of an output: its root's and those of
    the folders directly below it (``meshes`` writes ``OUT/mesh/``)."""
    if isinstance(source, Dataset):
        return
    m = read_manifest(source)
    store = _folder(source)
    if m is not None:
        yield (store.describe(MANIFEST) if store is not None else str(source)), m, True
    if store is None:
        return
    try:
        names = store.list_sync("")
    except SpecError:  # a store that cannot list (http): the root's manifest is all there is
        return
    for name in names:
        if name[:1] in "._" or "." in name:  # files (info, spec.json, ...), hidden and own names
            continue
        below = read_manifest(store.child(name))
        if below is not None:
            yield store.describe(f"{name}/{MANIFEST}"), below, False


def _folder(source: Any) -> ByteStore | None:
    """The output as a folder (None: a local file)."""
    if isinstance(source, ByteStore):
        return source
    if isinstance(source, dict) or "://" in os.fspath(source):
        return as_store(source)
    return as_store(source) if os.path.isdir(source) else None


def _as_found(problems: list[Problem]) -> list[Found]:
    return [Found(i, p) for i, p in enumerate(problems)]


def plan(source: Any, *, scale: int | None = None, decode: bool = False, spec: Any = None, spot_check: int = 0,
         seed: int = 0, report: VerifyReport | None = None) -> list[Task]:
    """The tasks that check ``source`` (see :func:`verify`); ``report`` gets the manifests read, the
    scales not exported and the export's store."""
    report = report if report is not None else VerifyReport("verify", str(source))
    tasks: list[Task] = []
    export = True
    if scale is None:
        try:
            found = list(_manifests(source))
        except DvidShardsError as e:
            return list(_as_found([Problem(str(source), type(e).__name__, str(e))]))
        for where, m, _ in found:
            report.manifests.append(m)
            tasks.append(ManifestCheck(where, json.dumps(m, default=str)))
            if m.get("job") == "convert" and spot_check > 0:
                tasks += _spot_checks(where, m, source, spec, spot_check, seed, report)
        root = next((m for _, m, at_root in found if at_root), None)
        export = not found or (root is not None and root.get("job") == "downsample")
    if not export:
        return tasks
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
        return tasks + _as_found([Problem(str(source), type(e).__name__, str(e))])
    problems: list[Problem] = []
    if scale is None:
        for f in sorted(folders - {s.folder for s in ds.scales}):
            if shard_origins(store, f):
                problems.append(Problem(store.describe(f), "SpecError", f"{store.describe(f)}: holds shards but the "
                                        f"spec has no scale {f[1:]}; they were not checked"))
        if isinstance(store, LayeredStore):  # a downsample output: its files, and its source's sizes now
            for i, st in enumerate(store.stores):
                made = downsample_manifest(st) if i else None
                if made is None:
                    continue
                below = store.stores[:i]
                tasks.append(SourceCheck(st, below[0] if i == 1 else LayeredStore(
                    below, {k: j for k, j in store.route.items() if j < i})))
                for k, n in (made.get("files") or {}).items():  # a made shard file lost in a copy reads as 0
                    held, where = len(shard_origins(st, f"s{k}")), st.describe(f"s{k}")
                    if held != n:
                        problems.append(Problem(where, "MissingShardError", f"{where}: holds {held} shard files, the "
                                                f"job wrote {n}: an incomplete copy"))
    for s in scales:
        try:
            origins = ds.shards(s)
            try:
                names = set(store.list_sync(s.folder))
            except SpecError:
                names = set()
        except DvidShardsError as e:
            problems.append(Problem(store.describe(s.folder), type(e).__name__, str(e)))
            continue
        for name in sorted(names):  # an index with no shard file beside it
            if name.endswith(".csv") and name[:-4] + ".arrow" not in names:
                w = store.describe(f"{s.folder}/{name}")
                problems.append(Problem(w, "MissingShardError", f"{w}: index without its .arrow"))
        tasks += [ShardCheck(ds, s.index, (int(o[0]), int(o[1]), int(o[2])), decode) for o in origins]
    if not any(isinstance(t, ShardCheck) for t in tasks) and not problems and not report.manifests:
        problems.append(Problem(store.describe(""), "SpecError", f"no shard files found under {store.describe('')}"))
    return tasks + _as_found(problems)


def _spot_checks(where: str, m: dict, source: Any, spec: Any, n: int, seed: int,
                 report: VerifyReport) -> list[Task]:
    """One spot check per scale of a conversion that it did not make itself."""
    params = m.get("parameters") or {}
    url = (m.get("source") or {}).get("url") if isinstance(m.get("source"), dict) else None
    fmt = m.get("format") or params.get("format")
    keys = m.get("keys") or {}
    if url is None or fmt is None:
        return list(_as_found([Problem(where, "SpecError", f"{where}: the manifest names no source or format")]))
    try:
        root = json.dumps(kvstore_root(source))
    except (DvidShardsError, ValueError, OSError) as e:
        return list(_as_found([Problem(where, type(e).__name__, f"{where}: {e}")]))
    made = {int(k) for k in m.get("made") or []}
    if made & {int(k) for k in keys}:
        report.notes.append(f"s{', s'.join(str(k) for k in sorted(made))}: made by the conversion (the source "
                            f"lacks them), not compared with it")
    given = spec if spec is not None else m.get("spec")
    text = None if given is None else json.dumps(given if isinstance(given, dict) else
                                                 json.loads(open(os.fspath(given), "rb").read()))
    box = params.get("box")
    return [SpotCheck(where, url, text, root, fmt, keys[k], int(k), params.get("labels", "agglomerated"), n, seed,
                      None if box is None else tuple(map(tuple, box)))
            for k in sorted(keys, key=int) if int(k) not in made]


# --------------------------------------------------------------------------- run_task, reduce


def run_task(task: Task) -> Checked:
    """Run one check (a problem is data, never an exception)."""
    return task.run()


def reduce(results: Any, report: VerifyReport) -> None:
    """The tasks' counts summed into ``report``, their problems and lines joined."""
    for r in results:
        report.totals.add(r.totals)
        report.problems += r.problems
        report.heads += r.heads
        report.notes += r.notes


# --------------------------------------------------------------------------- the job


def verify(source: Any, *, scale: int | None = None, decode: bool = False, spec: Any = None, spot_check: int = 0,
           seed: int = 0, scheduler: Any = "serial", progress: bool | None = False,
           allow_partial: bool = False) -> VerifyReport:
    """Check an export, or a job's output, end to end.

    Parameters
    ----------
    source : path, URL, kvstore spec dict, store or Dataset
        An export (every shard checked), or a job's output (every manifest in it read; a
        downsample output is also checked as the export it is, over its source).
    scale : int, optional
        Only this scale of an export (default: every scale it holds; the spec's others are in
        ``report.not_exported``, not problems).
    decode : bool
        Also decode every block and compare its label list.
    spec : dict or path, optional
        The export's neuroglancer spec (for a conversion: its source's).
    spot_check : int
        For a ``convert`` output: chunks per scale compared with the source its manifest names.
    seed : int
        Of the spot checks' random draws.
    scheduler, progress, allow_partial :
        As for every job (default: one task at a time, one shard in memory).

    Returns
    -------
    VerifyReport
        ``report.ok`` is False when a problem was found or nothing was checked.

    Raises
    ------
    JobError
        A check could not run (a task failed after its retries) and ``allow_partial`` is false.
    """
    t0 = time.perf_counter()
    report = VerifyReport("verify", source.store.describe("") if isinstance(source, Dataset) else
                          source.describe("") if isinstance(source, ByteStore) else str(source))
    tasks = plan(source, scale=scale, decode=decode, spec=spec, spot_check=spot_check, seed=seed, report=report)
    with TaskRunner(scheduler, progress=progress) as tr:
        phase = tr.run(run_task, tasks, desc="verify")
    report.tasks, report.done = len(tasks), len(phase.results)
    report.failed = {t.name(): msg for t, msg in phase.failed.items()}
    report.task_cpu = phase.task_cpu
    reduce(phase.results.values(), report)
    report.complete = not report.failed
    report.status = "complete" if report.complete else "incomplete"
    report.elapsed = time.perf_counter() - t0
    if not report.complete and not allow_partial:
        raise JobError(report.summary(), report)
    return report


# --------------------------------------------------------------------------- command line


class VerifyCommand:
    """``dvidshards verify EXPORT``."""

    @staticmethod
    def add_arguments(p: Any) -> None:
        add_source(p)
        p.add_argument("--scale", type=int, metavar="K", help="only scale K (folder sK); default: every scale")
        p.add_argument("--decode", action="store_true",
                       help="also decode every block and compare its label list with the record's")
        p.add_argument("--spot-check", type=int, default=0, metavar="N",
                       help="a convert output: also compare N random chunks per scale with the source its manifest "
                            "names")
        p.add_argument("--scheduler", default="serial", metavar="WHERE",
                       help="where the checks run (default serial: one shard in memory at a time)")
        p.add_argument("--quiet", action="store_true", help="no progress bar")

    @staticmethod
    def main(args: Any) -> int:
        """0: no problems; 1: problems found (or a check that could not run); nothing to check: SpecError (2)."""
        if args.spot_check < 0:
            raise SpecError(f"--spot-check {args.spot_check}: give a number of chunks >= 0")
        report = verify(args.source, scale=args.scale, decode=args.decode, spec=args.spec,
                        spot_check=args.spot_check, scheduler=args.scheduler, allow_partial=True,
                        progress=False if args.quiet else None)
        if not report.checked:  # nothing to check is a usage error, never "no problems"
            why = report.problems[0].message if report.problems else f"no shard files found under {args.source}"
            raise SpecError(f"nothing was checked: {' '.join(why.split())}")
        print(report.summary())
        return 0 if report.ok else 1
