"""Where every job writes, and how its output says what it holds.

Every whole-export job (convert, stats, label-index, meshes, pcg-edges, ingest, downsample) writes
through this module, so that the same rules hold for all of them:

* **One destination parser** (``stores.as_store(..., writable=True)``): a local path, ``file://``, ``gs://``,
  ``s3://`` (``?endpoint_override=host:port&scheme=http&region=r`` accepted), ``memory://`` or a
  TensorStore kvstore spec dict. Anything else (``http://``, ``grpc://``, a path that starts like a
  URL with a slash missing, ``gs:/bucket``) is refused in one line before any work, and nothing
  local is ever named like a URL. :meth:`Destination.probe` then checks, within a deadline, that
  the destination can be written: a bucket that does not answer fails in seconds, not minutes.
  Local files go through the operating system (atomic renames, errno messages); buckets through
  TensorStore's kvstore, the stack the readers use, with bounded retries and timeouts
  (``stores.local``, ``stores.kvstore``).
* **Errors that name the path**: a full disk, a read-only or forbidden folder, an unreachable
  bucket are one :class:`~dvidshards.errors.OutputError` line naming the path and what to do.
* **A lock on every output** (:class:`Lock`): ``_dvidshards.lock`` in the output folder (beside a
  one-file output: ``NAME._dvidshards.lock``), created exclusively (``O_EXCL`` locally, a write
  conditional on the key being absent in a bucket), refreshed by a heartbeat. A second job is
  refused naming the first (job, host, pid, start time); a lock whose owner died (same host: the
  process is gone; another host: no heartbeat for :data:`STALE_SECONDS`) is taken over with
  ``--resume``.
* **One manifest schema** (``_dvidshards.json``, :func:`read_manifest`): job, library version,
  parameters, command, source (URL), scales, ``complete``, ``status`` (``running``, ``complete``,
  ``incomplete``, ``interrupted``), failed tasks with their reasons, task counts, job-specific
  totals, start and end times. It is written ``complete: false`` before the first task and final
  at the end, from the same :class:`JobReport` the job returns and prints: the two cannot
  disagree. ``dvidshards verify DEST`` reads any job's manifest.
* **Refuse / resume / overwrite**: a destination that is empty (or absent) is used; one holding
  this job's own earlier output needs ``resume`` (same parameters; the job skips what is done)
  or ``overwrite`` (the job's own files are deleted first, others left alone); anything else is
  refused before any work.
* **One work folder** (``--workdir``, :func:`work_folder`): a job that keeps partial results
  (for ``--resume``, or for a reduce) keeps them in one folder that every worker sees: the one
  given (a shared file system or a bucket), else ``NAME.work`` beside the output ``NAME``
  (a sibling folder, or a sibling prefix in the same bucket); a bucket's root has no "beside":
  give ``--workdir``. It is locked like the output and must not overlap it or the source.
  ``Output(..., work=True)`` resolves it (``out.workdir``).
* **One store**: every byte goes through ``dvidshards.stores`` (``as_store(dest, writable=True)``:
  the one parser; atomic writes, create-if-absent and replace-if-equal for the lock); a
  :class:`Destination` is that store under the names jobs call.
* **One failure contract**: :meth:`Output.finish` returns the :class:`JobReport` when the output
  is complete; otherwise it raises :class:`~dvidshards.errors.JobError` carrying the report,
  unless the caller passed ``allow_partial=True``. The command line prints the summary and exits
  1. An interrupted job (Ctrl-C, SIGTERM) leaves ``status: interrupted`` and says how to finish.

A job reads as plan → tasks → reduce; this module is only the frame around them::

    with Output(dest, job="convert", parameters=params, source=ds, scales=[0, 1],
                resume=resume, overwrite=overwrite, own=own_names) as out:
        ...  # out.destination, out.previous (the earlier manifest when resuming)
        phase = runner.run(task, items, done=...)
        out.add(phase, name=str)
        return out.finish(totals=..., notes=[...], allow_partial=allow_partial)
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import JobError, OutputError, OutputLockedError, RemoteReadError, SpecError
from ..stores import ByteStore, as_store, is_temporary, os_error

__all__ = [
    "LOCK",
    "MANIFEST",
    "STALE_SECONDS",
    "Destination",
    "JobReport",
    "Lock",
    "Output",
    "check_apart",
    "is_temporary",
    "library_version",
    "os_error",
    "read_manifest",
    "work_folder",
]

D = TypeVar("D", bound="Destination")
MANIFEST = "_dvidshards.json"
LOCK = "_dvidshards.lock"
WORK_SUFFIX = ".work"  # the default work folder of output NAME is NAME.work beside it
SCHEMA = 1  # the manifest's schema version
#: seconds without a heartbeat after which another host's lock counts as abandoned
STALE_SECONDS = float(os.environ.get("DVIDSHARDS_LOCK_STALE_SECONDS", "600"))
HEARTBEAT_SECONDS = float(os.environ.get("DVIDSHARDS_LOCK_HEARTBEAT_SECONDS", "60"))


def library_version() -> str:
    """The installed dvidshards version (``unknown`` in a source tree that is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dvidshards")
    except PackageNotFoundError:  # pragma: no cover - a source tree without installation
        return "unknown"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


# --------------------------------------------------------------------------- the destination


class Destination:
    """Where a job writes: a writable store (``stores.as_store(dest, writable=True)``) under the
    names jobs call today. Each method is one call of the store's; the next jobs call the store.

    Use :meth:`of` to make one (it refuses what cannot be written).
    """

    def __init__(self, store: ByteStore):
        self.store = store

    @classmethod
    def of(cls, dest, *, what: str = "destination") -> Destination:
        """The destination a user named: a path, a URL, a kvstore spec dict, a store or a Destination.

        Raises
        ------
        OutputError
            A location no job can write to (an unknown scheme, a URL missing a slash, ...), in one
            line, before anything is touched.
        """
        if isinstance(dest, Destination):
            return dest
        return cls(as_store(dest, writable=True, what=what))

    def __reduce__(self):
        return (type(self), (self.store,))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Destination) and (self.path, self.spec) == (other.path, other.spec)

    def __hash__(self) -> int:
        return hash((self.path, json.dumps(self.spec, sort_keys=True)))

    @property
    def url(self) -> str:
        return self.store.describe("").rstrip("/") or "/"

    @property
    def path(self) -> str | None:
        """The absolute local path (None: not on this host's file system)."""
        p = self.store.local_path()
        return None if p is None else os.path.abspath(p)

    @property
    def local(self) -> bool:
        """Whether this is a path on this host's file system."""
        return self.path is not None

    @property
    def spec(self) -> dict | None:
        """Not local: the root's TensorStore kvstore spec (a memory store: the memory driver's)."""
        if self.local:
            return None
        spec = self.store.kvstore_spec()
        return spec if spec is not None else {"driver": "memory", "path": self.store.describe("")}

    @property
    def kvstore(self) -> dict:
        """The root as a TensorStore kvstore spec (path ending with '/'), for TensorStore's drivers."""
        spec = self.spec
        return spec if spec is not None else {"driver": "file", "path": (self.path or "").rstrip("/") + "/"}

    def describe(self, rel: str = "") -> str:
        """``rel`` as the user would name it (for messages)."""
        return f"{self.url}/{rel}" if rel and not self.local else (os.path.join(self.url, rel) if rel else self.url)

    def child(self: D, rel: str) -> D:
        """The folder ``rel`` under this one, as a Destination of its own."""
        return type(self)(self.store.child(rel))

    def parent_and_name(self: D) -> tuple[D, str]:
        """The folder holding this location and its last name (for one-file outputs)."""
        if self.path is not None:
            folder, name = os.path.split(self.path.rstrip("/"))
            return type(self)(as_store(folder, writable=True)), name
        spec = self.store.kvstore_spec()
        if spec is not None:
            folder, _, name = spec.get("path", "").rstrip("/").rpartition("/")
            parent = {**spec, "path": folder + "/" if folder else ""}
            return type(self)(as_store(parent, writable=not self.store.read_only)), name
        base, _, name = self.url.rstrip("/").rpartition("/")
        if base.endswith(":/"):
            return self, ""  # a store's root: nothing beside it
        return type(self)(as_store(base + "/", writable=True)), name

    def contains(self, other: Destination) -> bool:
        """Whether ``other`` is this location or inside it."""
        if self.path is not None and other.path is not None:
            a, b = os.path.realpath(self.path), os.path.realpath(other.path)
            return b == a or b.startswith(a.rstrip("/") + "/")
        if self.spec is not None and other.spec is not None:
            a_rest = {k: v for k, v in self.spec.items() if k != "path"}
            b_rest = {k: v for k, v in other.spec.items() if k != "path"}
            return a_rest == b_rest and other.spec.get("path", "").startswith(self.spec.get("path", ""))
        return False

    # --- one call of the store's each ---------------------------------------------------------------

    def read(self, rel: str) -> bytes | None:
        """The bytes of ``rel``, or None when it does not exist."""
        return self.store.get_sync(rel)

    def open_input(self, rel: str):
        """``rel`` as a readable, seekable binary file (ranged reads in a bucket)."""
        return self.store.open(rel)

    def size(self, rel: str) -> int:
        """The size of file ``rel`` in bytes."""
        return self.store.size_sync(rel)

    def read_range(self, rel: str, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of file ``rel``."""
        return bytes(self.store.read_sync(rel, start, stop))

    def exists(self, rel: str = "") -> bool:
        """Whether a file or a non-empty folder ``rel`` exists."""
        return self.store.exists_sync(rel) or self.store.is_folder_sync(rel)

    def is_dir(self, rel: str = "") -> bool:
        """Whether ``rel`` is a folder (in a bucket: a prefix holding objects)."""
        return self.store.is_folder_sync(rel)

    def list(self, rel: str = "") -> list[str]:
        """Names (files and folders) directly under ``rel``, sorted; ``[]`` when it is missing."""
        return self.store.list_sync(rel)

    def write(self, rel: str, data: bytes) -> None:
        """Write ``data`` to ``rel`` atomically (never seen half written)."""
        self.store.put_sync(rel, data)

    def write_with(self, rel: str, write: Callable[[Any], object]) -> None:
        """Call ``write(file)`` with a binary file open for writing, then publish it at ``rel`` atomically."""
        with self.store.writer(rel) as f:
            write(f)

    def create(self, rel: str, data: bytes) -> bool:
        """Write ``rel`` only if it does not exist (atomically); False when it already did."""
        return self.store.create_sync(rel, data)

    def replace_if(self, rel: str, data: bytes, expected: bytes) -> bool:
        """Write ``rel`` only if it still holds ``expected``; False when it changed (or is gone)."""
        return self.store.replace_sync(rel, data, expected=expected)

    def delete(self, rel: str) -> None:
        """Delete file ``rel`` if it exists."""
        self.store.delete_sync(rel)

    def rmtree(self, rel: str = "") -> None:
        """Delete ``rel`` (a file, or a folder and everything in it) if it exists."""
        self.store.delete_prefix_sync(rel)

    def local_path(self, rel: str = "") -> str:
        """The local path of ``rel`` (only for local destinations: writers that stream to a file)."""
        if self.path is None:
            raise ValueError(f"{self.describe()} is not on this host's file system")
        return os.path.join(self.path, rel)

    def makedirs(self, rel: str = "") -> None:
        """Make folder ``rel`` locally (a bucket has no folders: nothing to do)."""
        if self.path is not None:
            try:
                os.makedirs(os.path.join(self.path, rel), exist_ok=True)
            except OSError as e:
                raise os_error(e, self.describe(rel), "make the folder") from None

    def probe(self, *, kind: str = "folder") -> None:
        """Check that a job can write here, before any work; one OutputError line otherwise."""
        self.store.check_writable(kind=kind)


def work_folder(dest, workdir=None) -> Destination:
    """The work folder of a job writing ``dest``: ``workdir`` when given (``--workdir``), else
    ``NAME.work`` beside the output ``NAME`` (a sibling folder, or a sibling prefix in the same
    bucket: every worker that sees the output sees it). The one rule for every job.

    Raises
    ------
    OutputError
        There is no "beside" (the output is a bucket's or a file system's root): give ``workdir``.
    """
    if workdir is not None:
        return Destination.of(workdir, what="work folder")
    destination = Destination.of(dest)
    folder, name = destination.parent_and_name()
    if not name:
        raise OutputError(f"{destination.describe()}: a job keeps its partial results in a work folder beside "
                          f"the output, and there is none here; give --workdir (a folder, gs:// or s3://)")
    return folder.child(name + WORK_SUFFIX)


def _remove_empty_dirs(path: str) -> None:
    """Remove ``path`` and its parents while they are empty folders (what a refused job made)."""
    while path and os.path.isdir(path):
        try:
            os.rmdir(path)
        except OSError:
            return
        path = os.path.dirname(path)


def check_apart(dest: Destination, *, workdir: Destination | None = None, source=None,
                what: str = "output") -> None:
    """Refuse, before any work, an output inside the source export or sharing a folder with the
    work folder (the job would read or delete its own output)."""
    if workdir is not None and (dest.contains(workdir) or workdir.contains(dest)):
        raise OutputError(f"{what} {dest.describe()} and the work folder {workdir.describe()} overlap; give "
                          f"--workdir a folder of its own (or leave it out)")
    if source is not None:
        root = _source_root(source)
        if root is not None and (root.contains(dest) or dest == root):
            raise OutputError(f"{what} {dest.describe()} is inside the export {root.describe()}; a job never "
                              f"writes into its source: choose another destination")


def _source_root(source) -> Destination | None:
    """The export's root as a Destination when it is a plain location (for the overlap check)."""
    store = getattr(source, "store", None)
    for attr in ("root", "path"):
        p = getattr(store, attr, None)
        if isinstance(p, (str, os.PathLike)):
            try:
                return Destination.of(p)
            except OutputError:
                return None
    spec = getattr(store, "spec", None)
    if isinstance(spec, dict) and spec.get("driver") in ("gcs", "s3", "memory"):
        return Destination.of(spec)
    if isinstance(source, (str, os.PathLike)):
        try:
            return Destination.of(source)
        except OutputError:
            return None
    return None


# --------------------------------------------------------------------------- the lock


class Lock:
    """An exclusive lock on one output, held while a job writes it.

    Parameters
    ----------
    dest : ByteStore or Destination
        The output's folder (a writable store).
    name : str
        The lock's key in it (``_dvidshards.lock``; ``NAME._dvidshards.lock`` for a one-file output).
    job : str
        The job's name, for the message a second job gets.
    """

    def __init__(self, dest: Destination, job: str, name: str = LOCK):
        self.store: ByteStore = dest.store if isinstance(dest, Destination) else dest
        self.job, self.name = job, name
        self.token = uuid.uuid4().hex
        self.started = _now()
        self._body: bytes | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def _where(self) -> str:
        return self.store.describe("").rstrip("/") or "/"

    def _content(self) -> bytes:
        return json.dumps({"job": self.job, "host": socket.gethostname(), "pid": os.getpid(),
                           "started": self.started, "heartbeat": time.time(), "token": self.token}).encode()

    def owner(self) -> dict | None:
        """The current holder's record (None when unlocked or unreadable)."""
        data = self.store.get_sync(self.name)
        if data is None:
            return None
        try:
            d = json.loads(data)
        except ValueError:
            return {"job": "?", "host": "?", "pid": 0, "started": "?", "heartbeat": 0, "raw": data}
        return d if isinstance(d, dict) else None

    def acquire(self, *, take_over: bool = False) -> None:
        """Take the lock, or raise OutputLockedError naming its holder.

        A lock whose holder is gone (the process died on this host, or no heartbeat for
        :data:`STALE_SECONDS` from another host) is taken over when ``take_over`` (``--resume``).
        """
        body = self._content()
        if self.store.create_sync(self.name, body):
            self._body = body
            self._start_heartbeat()
            return
        owner = self.owner() or {}
        raw = self.store.get_sync(self.name)
        who = (f"`dvidshards {owner.get('job', '?')}` (host {owner.get('host', '?')}, pid {owner.get('pid', '?')}, "
               f"started {owner.get('started', '?')})")
        where = self.store.describe(self.name)
        if not _gone(owner):
            raise OutputLockedError(f"{self._where} is being written by {who}; wait for it to finish or "
                                    f"stop it (its lock: {where})")
        if not take_over:
            raise OutputLockedError(f"{self._where} was being written by {who}, which is gone; run the "
                                    f"same command with --resume to take its lock over and finish the output")
        if raw is None or not self.store.replace_sync(self.name, body, expected=raw):
            raise OutputLockedError(f"{self._where}: another job took the lock over at the same time "
                                    f"({where})")
        self._body = body
        self._start_heartbeat()

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="dvidshards-lock", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            body = self._content()
            try:
                if self._body is not None and self.store.replace_sync(self.name, body, expected=self._body):
                    self._body = body
            except OutputError:  # a transient failure: the next beat tries again
                pass

    @property
    def held(self) -> bool:
        return self._body is not None

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

    def __enter__(self) -> Lock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


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
    return time.time() - beat > STALE_SECONDS


# --------------------------------------------------------------------------- the manifest


def _parse_manifest(data: bytes, where: str) -> dict:
    try:
        m = json.loads(data)
    except ValueError as e:
        raise SpecError(f"{where}: not a dvidshards manifest ({_one_line(e)[:80]})") from None
    if not isinstance(m, dict) or "complete" not in m or not isinstance(m.get("job"), str):
        raise SpecError(f"{where}: not a dvidshards manifest (no 'job' and 'complete' members)")
    return m


def read_manifest(dest) -> dict | None:
    """The manifest of any job's output: ``_dvidshards.json`` in a folder, or the ``dvidshards``
    metadata of a one-file Parquet output. None when there is none.

    Raises
    ------
    SpecError
        The file is there but is not a manifest (damaged, or another program's).
    OutputError
        The location cannot be read.
    """
    if isinstance(dest, (str, os.PathLike)) and re.match(r"^https?://", os.fspath(dest)):
        d = Destination(as_store(os.fspath(dest), what="output"))  # read-only: an output served over http
    else:
        d = Destination.of(dest, what="output")
    try:
        if d.local and os.path.isfile(d.path or ""):
            return _file_manifest(d)
        data = d.read(MANIFEST)
        if data is None:
            folder, name = d.parent_and_name() if not d.local else (d, "")
            if name and folder.read(name) is not None:
                return _file_manifest(d)
            return None
    except RemoteReadError as e:
        raise OutputError(str(e)) from None
    return _parse_manifest(data, d.describe(MANIFEST))


def _file_manifest(d: Destination) -> dict | None:
    import pyarrow.parquet as pq

    folder, name = d.parent_and_name()
    try:
        with folder.open_input(name) as f:
            md = pq.ParquetFile(f).schema_arrow.metadata or {}
    except Exception:  # noqa: BLE001 - not a Parquet file: no manifest in it
        return None
    raw = md.get(b"dvidshards")
    return None if raw is None else _parse_manifest(raw, d.describe())


# --------------------------------------------------------------------------- the report


@dataclass
class JobReport:
    """What a job did, the same for every job; its manifest is written from it.

    Attributes
    ----------
    job : str
        The job (``convert``, ``stats``, ``downsample``, ...).
    dest : str
        The output, as the user named it.
    scales : list of int
        The scales the job worked on.
    tasks : int
        Tasks planned.
    done : int
        Tasks that succeeded in this run.
    skipped : int
        Tasks done by an earlier run and kept (``resume``).
    failed : dict
        ``{task: "TypeName: message"}`` of the tasks that failed (their files and chunks named).
    complete : bool
        Whether the output is whole: every task done and nothing else went wrong.
    status : str
        ``complete``, ``incomplete`` or ``interrupted``.
    totals : object
        The job's own figures (chunks written, bodies, ...), with ``to_json()`` or a dict.
    notes : list of str
        The job's own summary lines.
    elapsed, task_cpu : float
        Wall seconds of the job and CPU seconds of its tasks.
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
        """True when the output is complete and no task failed."""
        return self.complete and not self.failed

    def summary(self, limit: int = 10) -> str:
        """A few lines: what was done, the job's own figures, the first failures, and what to do."""
        state = "complete" if self.complete else ("INTERRUPTED" if self.status == "interrupted" else "INCOMPLETE")
        kept = f", {self.skipped:,} kept from an earlier run" if self.skipped else ""
        lines = [f"{self.job} -> {self.dest}: {state}: {self.done:,} of {self.tasks:,} tasks done{kept}, "
                 f"{len(self.failed):,} failed; {self.elapsed:.1f} s, {self.task_cpu:.1f} CPU s in tasks"]
        lines += [f"  {n}" for n in self.notes]
        for item, msg in list(self.failed.items())[:limit]:
            lines.append(f"  FAILED {item}: {msg}")
        if len(self.failed) > limit:
            lines.append(f"  ... and {len(self.failed) - limit:,} more" +
                         (f" (all in {self.manifest})" if self.manifest else ""))
        if not self.complete:
            where = f" (its {self.manifest} says so)" if self.manifest else ""
            lines.append(f"  the output is incomplete{where}; fix the cause and run the same command with --resume "
                         f"to finish it")
        return "\n".join(lines)

    def to_json(self) -> dict:
        t = self.totals
        if t is not None and hasattr(t, "to_json"):
            t = t.to_json()
        return {"tasks": {"total": self.tasks, "done": self.done, "kept": self.skipped, "failed": len(self.failed)},
                "failed": dict(self.failed), "totals": t, "notes": list(self.notes),
                "elapsed_s": round(self.elapsed, 3), "task_cpu_s": round(self.task_cpu, 3)}


# --------------------------------------------------------------------------- the frame of a job


class Output:
    """The frame every job runs in: destination checked, lock taken, manifest kept, report made.

    Parameters
    ----------
    dest : path, URL, kvstore spec dict or Destination
        The output: a folder (``kind="folder"``) or one file (``kind="file"``, e.g. a Parquet
        table; its manifest is the file's own metadata, written by the job, and the lock lies
        beside it).
    job : str
        The job's name (``convert``, ``stats``, ...).
    parameters : dict
        The arguments that decide the output's content (JSON). ``resume`` needs the same ones.
    source : optional
        The export (a path, URL or Dataset): recorded in the manifest, and an output inside it
        is refused.
    scales : list of int
    command : str, optional
        The command line, recorded in the manifest.
    resume, overwrite : bool
        See the module docstring.
    own : callable, optional
        ``name -> bool``: whether a top-level name of the destination is this job's output
        (deleted by ``overwrite``, which leaves other names alone). Default: everything but the
        manifest, the lock and hidden names is the job's.
    workdir : path, URL, kvstore spec dict or Destination, optional
        The job's work folder (``--workdir``): it is locked too, and must not overlap the output.
    work : bool
        The job keeps partial results: ``workdir`` (``out.workdir``, a :class:`WorkDir`-like
        Destination) is the one given or, when none is, the default of :func:`work_folder`.
    """

    def __init__(self, dest, *, job: str, parameters: dict, source=None, scales: Iterable[int] = (),
                 command: str | None = None, resume: bool = False, overwrite: bool = False,
                 own: Callable[[str], bool] | None = None, kind: str = "folder",
                 workdir=None, work: bool = False):
        if resume and overwrite:
            raise SpecError("give resume or overwrite, not both")
        if kind not in ("folder", "file"):
            raise ValueError(kind)
        self.destination = Destination.of(dest)
        self.job, self.parameters, self.kind = job, parameters, kind
        self.scales = [int(k) for k in scales]
        self.command, self.resume, self.overwrite = command, resume, overwrite
        self.source = source
        self.workdir = work_folder(self.destination, workdir) if work or workdir is not None else None
        self.own = own
        self.previous: dict | None = None
        self.report = JobReport(job, self.destination.describe(), list(self.scales))
        self._t0 = time.perf_counter()
        self._locks: list[Lock] = []
        self._finished = False
        self._manifest: dict | None = None
        if kind == "file":
            self.folder, self.name = self.destination.parent_and_name()
            self.report.manifest = None
        else:
            self.folder, self.name = self.destination, ""
            self.report.manifest = MANIFEST

    # --- opening -----------------------------------------------------------------------------------

    def __enter__(self) -> Output:
        made = self.folder.local and not os.path.exists(self.folder.local_path())
        try:
            self.open()
        except BaseException:
            self._release()
            if made:  # refused: leave no folder behind that was not there before
                _remove_empty_dirs(self.folder.local_path())
            raise
        return self

    def open(self) -> None:
        """Check the destination, take the locks, write the manifest ``complete: false``."""
        check_apart(self.destination, workdir=self.workdir, source=self.source)
        if self.workdir is not None:
            check_apart(self.workdir, source=self.source, what="work folder")
        self.destination.store.check_writable(kind=self.kind)
        if self.workdir is not None:
            self.workdir.store.check_writable()
        lock_name = f"{self.name}.{LOCK}" if self.kind == "file" else LOCK
        self._locks.append(Lock(self.folder, self.job, lock_name))
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

    def _is_own(self, name: str) -> bool:
        if name in (MANIFEST, LOCK) or name.startswith("."):
            return False
        return True if self.own is None else bool(self.own(name))

    def _check_folder(self) -> None:
        d, store = self.destination, self.destination.store
        names = [n for n in store.list_sync() if n not in (LOCK,) and not n.startswith(".")]
        has_manifest = MANIFEST in names
        prev = None
        if has_manifest:
            data = store.get_sync(MANIFEST)
            prev = _parse_manifest(data, d.describe(MANIFEST)) if data is not None else None
        rest = [n for n in names if n != MANIFEST]
        if not names:
            return
        if self.overwrite:
            self.previous = None
            for n in rest:
                if self._is_own(n):
                    store.delete_prefix_sync(n)
            if has_manifest:
                store.delete_sync(MANIFEST)
            return
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        if prev is None:
            raise OutputError(f"{d.describe()} is not empty and holds no dvidshards output ({shown}); choose an "
                              f"empty destination, or pass --overwrite to replace what this job would write there")
        if prev.get("job") != self.job:
            raise OutputError(f"{d.describe()} holds the output of `dvidshards {prev.get('job')}`, not "
                              f"{self.job}; choose another destination, or pass --overwrite")
        if not self.resume:
            state = "complete" if prev.get("complete") else "incomplete"
            raise OutputError(f"{d.describe()} holds an earlier {self.job} output ({state}); pass --resume to "
                              f"finish it, or --overwrite to start again")
        self._check_same(prev)
        self.previous = prev

    def _check_same(self, prev: dict) -> None:
        mine = (self._new_manifest().get("source") or {}).get("url")
        theirs = (prev.get("source") or {}).get("url")
        if mine != theirs:
            raise OutputError(f"{self.destination.describe()} holds a {self.job} output of another source "
                              f"({theirs}, now {mine}); choose another destination, or pass --overwrite")
        old = prev.get("parameters", {})
        for k in sorted(set(old) | set(self.parameters)):
            if old.get(k) != self.parameters.get(k):
                raise OutputError(f"{self.destination.describe()} holds a {self.job} output made with other "
                                  f"parameters ({k} was {old.get(k)!r}, now {self.parameters.get(k)!r}); "
                                  f"--resume needs the same ones: run the same command, or pass --overwrite")

    def _check_file(self) -> None:
        if not self.folder.store.exists_sync(self.name):
            return
        try:
            prev = read_manifest(self.destination)
        except SpecError:
            prev = None
        if prev is None or prev.get("job") != self.job:
            raise OutputError(f"{self.destination.describe()} exists and is not a {self.job} output; choose "
                              f"another name (--overwrite replaces only this job's own outputs)")
        if self.overwrite:
            return  # replaced atomically when the job writes it
        if not self.resume:
            raise OutputError(f"{self.destination.describe()} exists (an earlier {self.job} output); pass "
                              f"--overwrite to replace it")
        self._check_same(prev)
        self.previous = prev

    def _new_manifest(self) -> dict:
        source = None
        if self.source is not None:
            root = _source_root(self.source)
            source = {"url": root.describe() if root is not None else repr(self.source)}
        return {"dvidshards": {"manifest": SCHEMA, "version": library_version()}, "job": self.job,
                "parameters": self.parameters, "command": self.command, "source": source,
                "scales": self.scales, "complete": False, "status": "running",
                "started": (self.previous or {}).get("started") or _now(), "updated": _now(), "finished": None}

    def manifest(self) -> dict:
        """The manifest as it stands (for one-file outputs: to embed in the file's metadata)."""
        if self._manifest is None:
            self._manifest = self._new_manifest()
        return self._manifest

    def _write_manifest(self) -> None:
        if self.kind == "folder" and self._manifest is not None:
            self._manifest["updated"] = _now()
            self.destination.store.put_sync(MANIFEST, (json.dumps(self._manifest, indent=1, default=str) + "\n").encode())

    # --- while running -----------------------------------------------------------------------------

    def add(self, phase, name: Callable[[Any], str] = str) -> None:
        """Count one :meth:`TaskRunner.run` phase into the report (failures named by ``name``)."""
        self.report.tasks += len(phase.results) + len(phase.failed) + len(phase.skipped)
        self.report.done += len(phase.results)
        self.report.skipped += len(phase.skipped)
        for item, msg in phase.failed.items():
            self.report.failed[name(item)] = msg
        self.report.task_cpu += phase.task_cpu
        if getattr(phase, "dashboard", None):
            self.report.dashboard = phase.dashboard

    def fail(self, item: str, message: str) -> None:
        """Record a failure that is not a task's (e.g. a check after the tasks)."""
        self.report.failed[item] = message

    def update(self, **members) -> None:
        """Merge members into the manifest and write it (job-specific progress, e.g. per-scale keys)."""
        self.manifest().update(members)
        self._write_manifest()

    # --- the end -----------------------------------------------------------------------------------

    def finish(self, *, totals=None, notes: Iterable[str] = (), complete: bool | None = None,
               allow_partial: bool = False, write: Callable[[dict], None] | None = None) -> JobReport:
        """Write the final manifest, release the locks, and return the report.

        Parameters
        ----------
        totals, notes :
            The job's own figures and summary lines.
        complete : bool, optional
            Whether the output is whole (default: no task failed).
        allow_partial : bool
            Return an incomplete report instead of raising.
        write : callable, optional
            One-file outputs: ``write(manifest)`` publishes the file with the final manifest in its
            metadata (called only when the output is complete).

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
            if self.kind == "file":
                if r.complete and write is not None:
                    write(m)
            else:
                self._write_manifest()
        finally:
            self._finished = True
            self._release()
        if not r.complete and not allow_partial:
            raise JobError(r.summary(), r)
        return r

    def __exit__(self, kind, exc, tb) -> None:
        if self._finished:
            return
        try:
            if exc is not None and self._manifest is not None and self.kind == "folder":
                interrupted = isinstance(exc, (KeyboardInterrupt, SystemExit))
                self._manifest.update({"complete": False, "status": "interrupted" if interrupted else "incomplete",
                                       "error": f"{type(exc).__name__}: {_one_line(exc)}", "finished": _now(),
                                       **self.report.to_json()})
                try:
                    self._write_manifest()
                except OutputError:
                    pass
            if isinstance(exc, (KeyboardInterrupt, SystemExit)) and self._locks:
                msg = (f"dvidshards {self.job}: interrupted: {self.destination.describe()} is incomplete"
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
