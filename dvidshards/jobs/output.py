"""Where every job writes and how its output says what it holds: the frame every job runs in.

:class:`Output` checks the destination (one store, ``stores.as_store(dest, writable=True)``: what
cannot be written is one ``OutputError`` line before any work), locks it (:class:`Lock`), keeps its
manifest (``_dvidshards.json``, or a one-file output's own metadata; :func:`read_manifest`) written
from the :class:`JobReport` the job returns, and decides refuse / resume / overwrite. The work folder
is :func:`work_folder`'s. A job is its plan, tasks and reduce in this frame::

    with Output(dest, job="convert", parameters=params, source=ds, scales=[0, 1],
                resume=resume, overwrite=overwrite) as out:
        phase = runner.run(run_task, plan(...), done=...)
        out.add(phase, name=str)
        return out.finish(totals=reduce(phase.results.values()), allow_partial=allow_partial)

``DVIDSHARDS_PAUSE_FILE=PATH`` (tests that interrupt a job): the first :meth:`Output.add` that counts
a finished task creates PATH and waits until it is deleted, so a test acts on a job known to be
mid-way, never on a guess of how long it runs.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import JobError, OutputError, OutputLockedError, RemoteReadError, SpecError
from ..pyramid import MANIFEST, parse_manifest
from ..stores import ByteStore, as_store

__all__ = ["LOCK", "MANIFEST", "JobReport", "Lock", "Output", "read_manifest", "work_folder"]

LOCK = "_dvidshards.lock"
SCHEMA = 1  # the manifest's schema version
#: seconds without a heartbeat after which another host's lock counts as abandoned
STALE_SECONDS = float(os.environ.get("DVIDSHARDS_LOCK_STALE_SECONDS", "600"))
HEARTBEAT_SECONDS = float(os.environ.get("DVIDSHARDS_LOCK_HEARTBEAT_SECONDS", "60"))
_PAUSE_FILE = os.environ.get("DVIDSHARDS_PAUSE_FILE") or None


def package_version() -> str:
    """dvidshards' installed version, as its manifests and ``--version`` say it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dvidshards")
    except PackageNotFoundError:  # pragma: no cover - a source tree on sys.path, never installed
        return "unknown (not installed)"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


# --------------------------------------------------------------------------- locations


def _where(store: ByteStore) -> str:
    return store.describe("").rstrip("/") or "/"


def parent_and_name(store: ByteStore) -> tuple[ByteStore, str]:
    """The folder holding a location and its last name (``""`` at a store's root)."""
    path = store.local_path()
    if path is not None:
        folder, name = os.path.split(os.path.abspath(path).rstrip("/"))
        return as_store(folder, writable=True), name
    spec = store.kvstore_spec()
    if spec is not None:
        folder, _, name = spec.get("path", "").rstrip("/").rpartition("/")
        return as_store({**spec, "path": folder + "/" if folder else ""}, writable=not store.read_only), name
    base, _, name = _where(store).rpartition("/")
    if base.endswith(":/"):
        return store, ""  # memory://NAME: nothing beside it
    return as_store(base + "/", writable=True), name


def _contains(outer: ByteStore, inner: ByteStore) -> bool:
    a, b = outer.local_path(), inner.local_path()
    if a is not None and b is not None:
        a, b = os.path.realpath(a), os.path.realpath(b)
        return b == a or b.startswith(a.rstrip("/") + "/")
    if (a is None) != (b is None):
        return False
    return (_where(inner) + "/").startswith(_where(outer).rstrip("/") + "/")


def _relative(frm: ByteStore, to: ByteStore) -> str | None:
    """``to`` relative to ``frm`` (both local, or in one bucket): a manifest records it beside its
    source's URL, so that an output and its source moved or uploaded together find each other."""
    a, b = frm.local_path(), to.local_path()
    if a is not None and b is not None:
        return os.path.relpath(os.path.abspath(b), os.path.abspath(a))
    sa, sb = frm.kvstore_spec(), to.kvstore_spec()
    if a is None and b is None and sa is not None and sb is not None:
        pa, pb = sa.pop("path", ""), sb.pop("path", "")
        if sa == sb:
            return posixpath.relpath("/" + pb.strip("/"), "/" + pa.strip("/"))
    return None


def work_folder(dest: Any, workdir: Any = None) -> ByteStore:
    """The work folder of a job writing ``dest``, the one rule for every job: ``workdir`` when given
    (``--workdir``), else ``NAME.work`` beside the output ``NAME`` (in the same bucket too: every
    worker that sees the output sees it).

    Raises
    ------
    OutputError
        The output is a bucket's or a file system's root (nothing beside it): give ``workdir``.
    """
    if workdir is not None:
        return as_store(workdir, writable=True, what="work folder")
    store = as_store(dest, writable=True)
    folder, name = parent_and_name(store)
    if not name:
        raise OutputError(f"{_where(store)}: a job keeps its partial results in a work folder beside "
                          f"the output, and there is none here; give --workdir (a folder, gs:// or s3://)")
    return folder.child(name + ".work")


def _made_here(path: str) -> tuple[str, str | None]:
    """``path`` and its outermost ancestor that does not exist yet (None: ``path`` exists)."""
    p, top = os.path.abspath(path), None
    while not os.path.exists(p):
        top, p = p, os.path.dirname(p)
    return os.path.abspath(path), top


def _remove_empty_dirs(path: str, top: str | None) -> None:
    """Remove ``path`` and its parents up to ``top`` while they are empty (what a refused job made)."""
    while top is not None and os.path.isdir(path):
        try:
            os.rmdir(path)
        except OSError:
            return
        if path == top:
            return
        path = os.path.dirname(path)


def _check_apart(dest: ByteStore, *, workdir: ByteStore | None = None, source: Any = None,
                 what: str = "output") -> None:
    """Refuse an output inside its source, or overlapping the work folder (it would read or delete itself)."""
    if workdir is not None and (_contains(dest, workdir) or _contains(workdir, dest)):
        raise OutputError(f"{what} {_where(dest)} and the work folder {_where(workdir)} overlap; give "
                          f"--workdir a folder of its own (or leave it out)")
    root = _source_root(source)
    if root is not None and _contains(root, dest):
        raise OutputError(f"{what} {_where(dest)} is inside the export {_where(root)}; a job never "
                          f"writes into its source: choose another destination")


def _source_root(source: Any) -> ByteStore | None:
    """The export's root when it is one location (a path, URL, store, or a Dataset over one)."""
    if source is None:
        return None
    store = getattr(source, "store", source)
    if isinstance(store, ByteStore):
        return store if not hasattr(store, "stores") else None  # several roots: no one location
    try:
        return as_store(source)
    except (SpecError, OutputError, TypeError):
        return None


# --------------------------------------------------------------------------- the lock


class Lock:
    """An exclusive lock on one output (``name`` in its folder ``store``), held while a job writes it;
    a heartbeat thread keeps it fresh. ``job`` names the holder in the message a second job gets."""

    def __init__(self, store: ByteStore, job: str, name: str = LOCK):
        self.store = store
        self.job, self.name = job, name
        self.token = uuid.uuid4().hex
        self.started = _now()
        self._body: bytes | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _content(self) -> bytes:
        return json.dumps({"job": self.job, "host": socket.gethostname(), "pid": os.getpid(),
                           "started": self.started, "heartbeat": time.time(), "token": self.token}).encode()

    def acquire(self, *, take_over: bool = False) -> None:
        """Take the lock, or raise OutputLockedError naming its holder. A lock whose holder is gone
        (a dead process on this host, or no heartbeat for :data:`STALE_SECONDS`) is taken over when
        ``take_over`` (``--resume``)."""
        body = self._content()
        if not self.store.create_sync(self.name, body):
            raw = self.store.get_sync(self.name)
            try:
                owner = json.loads(raw) if raw is not None else {}
            except ValueError:
                owner = {"job": "?", "host": "?", "pid": 0, "started": "?", "heartbeat": 0}
            owner = owner if isinstance(owner, dict) else {}
            who = (f"`dvidshards {owner.get('job', '?')}` (host {owner.get('host', '?')}, pid "
                   f"{owner.get('pid', '?')}, started {owner.get('started', '?')})")
            folder, where = _where(self.store), self.store.describe(self.name)
            if not _gone(owner):
                raise OutputLockedError(f"{folder} is being written by {who}; wait for it to finish or "
                                        f"stop it (its lock: {where})")
            if not take_over:
                raise OutputLockedError(f"{folder} was being written by {who}, which is gone; run the "
                                        f"same command with --resume to take its lock over and finish the output")
            if raw is None or not self.store.replace_sync(self.name, body, expected=raw):
                raise OutputLockedError(f"{folder}: another job took the lock over at the same time ({where})")
        self._body = body
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="dvidshards-lock", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            body = self._content()
            try:
                if self._body is not None and self.store.replace_sync(self.name, body, expected=self._body):
                    self._body = body
            except OutputError:  # transient: the next beat tries again
                pass

    def release(self) -> None:
        """Give the lock back (only if it is still ours)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._body is None:
            return
        try:
            if self.store.get_sync(self.name) == self._body:
                self.store.delete_sync(self.name)
        except OutputError:
            pass
        self._body = None


def _gone(owner: dict) -> bool:
    """Whether a lock's holder is no longer running."""
    if not owner:
        return True
    try:
        beat = float(owner.get("heartbeat", 0))
    except (TypeError, ValueError):
        beat = 0.0
    if owner.get("host") == socket.gethostname():
        try:
            pid = int(owner.get("pid", 0))
        except (TypeError, ValueError):
            return True
        if pid <= 0:
            return True
        if pid == os.getpid():
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
    return time.time() - beat > STALE_SECONDS


# --------------------------------------------------------------------------- the manifest


def read_manifest(dest: Any) -> dict | None:
    """The manifest of any job's output: ``_dvidshards.json`` in a folder, or the ``dvidshards``
    metadata of a one-file Parquet output; None when there is none.

    Raises
    ------
    SpecError
        The file is there but is not a manifest (damaged, or another program's).
    OutputError
        The location cannot be read.
    """
    if isinstance(dest, ByteStore):
        store = dest
    elif isinstance(dest, (str, os.PathLike)) and re.match(r"^https?://", os.fspath(dest)):
        store = as_store(os.fspath(dest), what="output")  # read-only: an output served over http
    else:
        store = as_store(dest, writable=True, what="output")
    try:
        path = store.local_path()
        if path is not None and os.path.isfile(path):
            return _file_manifest(store)
        data = store.get_sync(MANIFEST)
        if data is None:
            folder, name = parent_and_name(store) if path is None else (store, "")
            return _file_manifest(store) if name and folder.exists_sync(name) else None
    except RemoteReadError as e:
        raise OutputError(str(e)) from None
    return parse_manifest(data, store.describe(MANIFEST))


def _file_manifest(store: ByteStore) -> dict | None:
    import pyarrow.parquet as pq

    folder, name = parent_and_name(store)
    try:
        with folder.open(name) as f:
            md = pq.ParquetFile(f).schema_arrow.metadata or {}
    except Exception:  # noqa: BLE001 - not a Parquet file: no manifest in it
        return None
    raw = md.get(b"dvidshards")
    return None if raw is None else parse_manifest(raw, _where(store))


# --------------------------------------------------------------------------- the report


@dataclass
class JobReport:
    """What a job did, the same for every job; its manifest is written from it.

    Attributes
    ----------
    job, dest : str
        The job (``convert``, ``stats``, ...) and its output as the user named it.
    scales : list of int
    tasks, done, skipped : int
        Tasks planned, done in this run, and kept from an earlier run (``resume``).
    failed : dict
        ``{task: "TypeName: message"}`` of the tasks that failed.
    complete : bool
        Every task done and nothing else went wrong.
    status : str
        ``complete``, ``incomplete`` or ``interrupted``.
    totals : object
        The job's own figures (``to_json()`` or a dict).
    notes : list of str
        The job's own summary lines.
    elapsed, task_cpu : float
        Wall seconds of the job, CPU seconds of its tasks.
    """

    job: str
    dest: str
    scales: list = field(default_factory=list)
    tasks: int = 0
    done: int = 0
    skipped: int = 0
    failed: dict = field(default_factory=dict)
    complete: bool = False
    status: str = "running"
    totals: Any = None
    notes: list = field(default_factory=list)
    elapsed: float = 0.0
    task_cpu: float = 0.0
    dashboard: str | None = None
    manifest: str | None = None

    @property
    def ok(self) -> bool:
        """The output is complete and no task failed."""
        return self.complete and not self.failed

    def summary(self, limit: int = 10) -> str:
        """A few lines: what was done, the job's figures, the first failures, and what to do."""
        state = "complete" if self.complete else ("INTERRUPTED" if self.status == "interrupted" else "INCOMPLETE")
        kept = f", {self.skipped:,} kept from an earlier run" if self.skipped else ""
        lines = [f"{self.job} -> {self.dest}: {state}: {self.done:,} of {self.tasks:,} tasks done{kept}, "
                 f"{len(self.failed):,} failed; {self.elapsed:.1f} s, {self.task_cpu:.1f} CPU s in tasks"]
        lines += [f"  {n}" for n in self.notes]
        lines += [f"  FAILED {item}: {msg}" for item, msg in list(self.failed.items())[:limit]]
        if len(self.failed) > limit:
            lines.append(f"  ... and {len(self.failed) - limit:,} more" +
                         (f" (all in {self.manifest})" if self.manifest else ""))
        if not self.complete:
            where = f" (its {self.manifest} says so)" if self.manifest else ""
            lines.append(f"  the output is incomplete{where}; fix the cause and run the same command with --resume "
                         f"to finish it")
        return "\n".join(lines)

    def to_json(self) -> dict:
        t = self.totals.to_json() if hasattr(self.totals, "to_json") else self.totals
        return {"tasks": {"total": self.tasks, "done": self.done, "kept": self.skipped, "failed": len(self.failed)},
                "failed": dict(self.failed), "totals": t, "notes": list(self.notes),
                "elapsed_s": round(self.elapsed, 3), "task_cpu_s": round(self.task_cpu, 3)}


# --------------------------------------------------------------------------- the frame of a job


class Output:
    """The frame every job runs in: destination checked, locks taken, manifest kept, report made.

    Parameters
    ----------
    dest : path, URL, kvstore spec dict or ByteStore
        A folder (``kind="folder"``), or one file (``kind="file"``, e.g. a Parquet table whose own
        metadata is its manifest, written by the job; its lock lies beside it). ``out.store``.
    job : str
    parameters : dict
        The arguments that decide the output's content (JSON); ``resume`` needs the same ones.
    source : optional
        The export (path, URL, store or Dataset): recorded in the manifest (URL, and path relative
        to the output); an output inside it is refused.
    identity : dict, optional
        What the job records of its source's content: a source at another URL with the same
        identity is the same source, moved, for ``resume``.
    scales : list of int
    command : str, optional
        The command line, for the manifest.
    resume, overwrite : bool
        An empty destination is used; this job's own earlier output needs ``resume`` (same
        parameters and source) or ``overwrite`` (its own files deleted, others kept).
    own : callable, optional
        ``name -> bool``: whether a top-level name is this job's (what ``overwrite`` deletes).
        Default: everything but the manifest, the lock and hidden names.
    workdir : path, URL, kvstore spec dict or ByteStore, optional
        The work folder (``--workdir``): locked too, and apart from the output.
    work : bool
        The job keeps partial results: ``out.workdir`` is ``workdir`` or :func:`work_folder`'s default.
    """

    def __init__(self, dest: Any, *, job: str, parameters: dict, source: Any = None,
                 identity: dict | None = None, scales: Iterable[int] = (), command: str | None = None,
                 resume: bool = False, overwrite: bool = False, own: Callable[[str], bool] | None = None,
                 kind: str = "folder", workdir: Any = None, work: bool = False):
        if resume and overwrite:
            raise SpecError("give resume or overwrite, not both")
        if kind not in ("folder", "file"):
            raise ValueError(kind)
        self.store = as_store(dest, writable=True)
        self.job, self.parameters, self.kind = job, parameters, kind
        self.scales = [int(k) for k in scales]
        self.command, self.resume, self.overwrite = command, resume, overwrite
        self.source, self.identity, self.own = source, identity, own
        self.workdir = work_folder(self.store, workdir) if work or workdir is not None else None
        self.previous: dict | None = None
        self.where = _where(self.store)
        self.report = JobReport(job, self.where, list(self.scales))
        self._t0 = time.perf_counter()
        self._locks: list[Lock] = []
        self._finished = False
        self._manifest: dict | None = None
        if kind == "file":
            self.folder, self.name = parent_and_name(self.store)
        else:
            self.folder, self.name = self.store, ""
            self.report.manifest = MANIFEST

    def __enter__(self) -> Output:
        paths = [st.local_path() for st in (self.folder, self.workdir) if st is not None]
        made = [_made_here(p) for p in paths if p is not None]
        try:
            self.open()
        except BaseException:
            self._release()
            for path, top in made:  # refused: leave no folder behind that was not there before
                _remove_empty_dirs(path, top)
            raise
        return self

    def open(self) -> None:
        """Check the destination, take the locks, write the manifest ``complete: false``."""
        _check_apart(self.store, workdir=self.workdir, source=self.source)
        if self.workdir is not None:
            _check_apart(self.workdir, source=self.source, what="work folder")
        self.store.check_writable(kind=self.kind)
        if self.workdir is not None:
            self.workdir.check_writable()
        self._locks.append(Lock(self.folder, self.job, f"{self.name}.{LOCK}" if self.kind == "file" else LOCK))
        if self.workdir is not None:
            self._locks.append(Lock(self.workdir, self.job))
        for lock in self._locks:
            lock.acquire(take_over=self.resume)
        if self.kind == "folder":
            self._check_folder()
            self._manifest = self._new_manifest()
            self._write_manifest()
        else:
            self._check_file()

    def _check_folder(self) -> None:
        store = self.store
        names = [n for n in store.list_sync() if n != LOCK and not n.startswith(".")]
        if not names:
            return
        data = store.get_sync(MANIFEST) if MANIFEST in names else None
        prev = parse_manifest(data, store.describe(MANIFEST)) if data is not None else None
        if self.overwrite:
            for n in names:
                if n != MANIFEST and (self.own is None or self.own(n)):
                    store.delete_prefix_sync(n)
            if MANIFEST in names:
                store.delete_sync(MANIFEST)
            return
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        if prev is None:
            raise OutputError(f"{self.where} is not empty and holds no dvidshards output ({shown}); choose an "
                              f"empty destination, or pass --overwrite to replace what this job would write there")
        if prev.get("job") != self.job:
            raise OutputError(f"{self.where} holds the output of `dvidshards {prev.get('job')}`, not "
                              f"{self.job}; choose another destination, or pass --overwrite")
        if not self.resume:
            state = "complete" if prev.get("complete") else "incomplete"
            raise OutputError(f"{self.where} holds an earlier {self.job} output ({state}); pass --resume to "
                              f"finish it, or --overwrite to start again")
        self._check_same(prev)

    def _check_file(self) -> None:
        if not self.folder.exists_sync(self.name):
            return
        try:
            prev = read_manifest(self.store)
        except SpecError:
            prev = None
        if prev is None or prev.get("job") != self.job:
            raise OutputError(f"{self.where} exists and is not a {self.job} output; choose "
                              f"another name (--overwrite replaces only this job's own outputs)")
        if self.overwrite:
            return  # replaced atomically when the job writes it
        if not self.resume:
            raise OutputError(f"{self.where} exists (an earlier {self.job} output); pass "
                              f"--overwrite to replace it")
        self._check_same(prev)

    def _check_same(self, prev: dict) -> None:
        """``resume`` of an earlier output: the same source (or its files moved) and parameters."""
        mine: dict = self._new_manifest().get("source") or {}
        theirs: dict = prev["source"] if isinstance(prev.get("source"), dict) else {}
        a, b = mine.get("identity"), theirs.get("identity")
        moved = a is not None and b is not None and all(a.get(k) == b.get(k) for k in ("scale", "shards", "sha256"))
        if mine.get("url") != theirs.get("url") and not moved:
            raise OutputError(f"{self.where} holds a {self.job} output of another source "
                              f"({theirs.get('url')}, now {mine.get('url')}); choose another destination, or pass "
                              f"--overwrite")
        old = prev.get("parameters", {})
        for k in sorted(set(old) | set(self.parameters)):
            if old.get(k) != self.parameters.get(k):
                raise OutputError(f"{self.where} holds a {self.job} output made with other "
                                  f"parameters ({k} was {old.get(k)!r}, now {self.parameters.get(k)!r}); "
                                  f"--resume needs the same ones: run the same command, or pass --overwrite")
        self.previous = prev

    def _new_manifest(self) -> dict:
        source: dict | None = None
        if self.source is not None:
            root = _source_root(self.source)
            if root is not None:
                source = {"url": _where(root), "relative": _relative(self.folder, root)}
            else:
                desc = getattr(getattr(self.source, "store", None), "describe", None)
                source = {"url": desc("") if desc is not None else repr(self.source)}
            if self.identity is not None:
                source["identity"] = self.identity
        return {"dvidshards": {"manifest": SCHEMA, "version": package_version()}, "job": self.job,
                "parameters": self.parameters, "command": self.command, "source": source,
                "scales": self.scales, "complete": False, "status": "running",
                "started": (self.previous or {}).get("started") or _now(), "updated": _now(), "finished": None}

    def manifest(self) -> dict:
        """The manifest as it stands (a one-file output embeds it in its metadata)."""
        if self._manifest is None:
            self._manifest = self._new_manifest()
        return self._manifest

    def _write_manifest(self) -> None:
        if self.kind == "folder" and self._manifest is not None:
            self._manifest["updated"] = _now()
            self.store.put_sync(MANIFEST, (json.dumps(self._manifest, indent=1, default=str) + "\n").encode())

    def add(self, phase: Any, name: Callable[[Any], str] = str) -> None:
        """Count one :meth:`TaskRunner.run` phase into the report (failures named by ``name``)."""
        self.report.tasks += len(phase.results) + len(phase.failed) + len(phase.skipped)
        self.report.done += len(phase.results)
        self.report.skipped += len(phase.skipped)
        for item, msg in phase.failed.items():
            self.report.failed[name(item)] = msg
        self.report.task_cpu += phase.task_cpu
        if getattr(phase, "dashboard", None):
            self.report.dashboard = phase.dashboard
        if _PAUSE_FILE is not None and phase.results:
            _pause()

    def fail(self, item: str, message: str) -> None:
        """Record a failure that is not a task's (e.g. a check after the tasks)."""
        self.report.failed[item] = message

    def update(self, **members: Any) -> None:
        """Merge members into the manifest and write it (the job's own keys)."""
        self.manifest().update(members)
        self._write_manifest()

    def finish(self, *, totals: Any = None, notes: Iterable[str] = (), complete: bool | None = None,
               allow_partial: bool = False, write: Callable[[dict], None] | None = None) -> JobReport:
        """Write the final manifest, release the locks, return the report: the failure contract of
        every job (an incomplete output raises unless ``allow_partial``).

        Parameters
        ----------
        totals, notes :
            The job's own figures and summary lines.
        complete : bool, optional
            Whether the output is whole (default: no task failed).
        allow_partial : bool
            Return an incomplete report instead of raising.
        write : callable, optional
            One-file outputs: ``write(manifest)`` publishes the file, the final manifest in its
            metadata (only when the output is complete).

        Raises
        ------
        JobError
            The output is incomplete and ``allow_partial`` is false; ``.report`` is the report.
        """
        r = self.report
        r.totals = totals if totals is not None else r.totals
        r.notes = list(notes)
        r.complete = (not r.failed) if complete is None else bool(complete) and not r.failed
        r.status = "complete" if r.complete else "incomplete"
        r.elapsed = time.perf_counter() - self._t0
        m = self.manifest()
        m.update({"complete": r.complete, "status": r.status, "finished": _now(), **r.to_json()})
        try:
            if self.kind == "folder":
                self._write_manifest()
            elif r.complete and write is not None:
                write(m)
        finally:
            self._finished = True
            self._release()
        if not r.complete and not allow_partial:
            raise JobError(r.summary(), r)
        return r

    def __exit__(self, kind: Any, exc: BaseException | None, _tb: Any) -> None:
        if self._finished:
            return
        interrupted = isinstance(exc, (KeyboardInterrupt, SystemExit))
        try:
            if exc is not None and self._manifest is not None and self.kind == "folder":
                self._manifest.update({"complete": False, "status": "interrupted" if interrupted else "incomplete",
                                       "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
                                       "finished": _now(), **self.report.to_json()})
                try:
                    self._write_manifest()
                except OutputError:
                    pass
            if isinstance(exc, (KeyboardInterrupt, SystemExit)) and self._locks:
                msg = (f"dvidshards {self.job}: interrupted: {self.where} is incomplete"
                       + (f" (its {MANIFEST} says so)" if self.kind == "folder" else "")
                       + "; run the same command with --resume to finish it")
                print(msg, file=sys.stderr, flush=True)
                if hasattr(exc, "add_note"):
                    exc.add_note(msg)
        finally:
            self._release()

    def _release(self) -> None:
        for lock in reversed(self._locks):
            lock.release()
        self._locks = []


def _pause() -> None:
    """``DVIDSHARDS_PAUSE_FILE``: create the file, then wait until it is deleted (once per process)."""
    global _PAUSE_FILE
    path, _PAUSE_FILE = _PAUSE_FILE, None
    assert path is not None
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)  # appears whole
    while os.path.exists(path):
        time.sleep(0.02)
