"""A job's folder on a local disk or an object store: partial results, manifests, outputs.

Whole-export jobs keep what their tasks wrote in a *work folder* that every worker reaches (a
local folder for threads and a ``LocalCluster``; a shared file system or a bucket on a cluster),
and write their outputs from the workers. `WorkDir` is that folder: a path or a URL that
``pyarrow.fs.FileSystem.from_uri`` opens (``gs://bucket/prefix``, ``s3://bucket/prefix``,
``s3://bucket/prefix?endpoint_override=host:port&scheme=http``, ``file:///abs/path``), with the
few operations jobs need. It pickles as its URL, so a worker opens the file system with its own
credentials.

Every file is written under a hidden temporary name in its final folder (``.NAME.tmp-XXXX``,
which dataset readers skip) and moved to its name when complete: a failed or killed task leaves no
file under a real name (on an object store the move is a server-side copy).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ..errors import SpecError

__all__ = ["WorkDir", "is_temporary", "is_url"]

_TMP = ".tmp-"


def is_url(location) -> bool:
    """Whether ``location`` names a file system by URL (``scheme://``) rather than a local path."""
    return "://" in os.fspath(location)


class WorkDir:
    """A folder on any file system ``pyarrow.fs`` opens; paths inside it are ``/``-joined names.

    Parameters
    ----------
    location : str, os.PathLike or WorkDir
        A local path (made absolute) or a URL (``gs://``, ``s3://``, ``file://``).

    Raises
    ------
    SpecError
        A URL that ``pyarrow.fs`` cannot open (unknown scheme, bad options).
    """

    def __init__(self, location):
        if isinstance(location, WorkDir):
            self.url, self.fs, self.path = location.url, location.fs, location.path
            return
        text = os.fspath(location)
        if is_url(text) and not text.startswith("file://"):
            try:
                self.fs, path = pafs.FileSystem.from_uri(text)
            except (ValueError, OSError, TypeError) as e:
                raise SpecError(f"{text}: cannot open this folder ({' '.join(str(e).split())[:200]})") from None
            self.path = path.rstrip("/")
            self.url = text
        else:
            self.path = os.path.abspath(text.removeprefix("file://"))
            self.fs = pafs.LocalFileSystem()
            self.url = self.path

    def __reduce__(self):
        return (WorkDir, (self.url,))

    def __repr__(self) -> str:
        return f"WorkDir({self.url!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, WorkDir) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    @property
    def local(self) -> bool:
        """Whether this is a folder of this host's file system (a path, not a bucket)."""
        return isinstance(self.fs, pafs.LocalFileSystem)

    def full(self, rel: str = "") -> str:
        """The file system path of ``rel`` inside this folder."""
        return f"{self.path}/{rel}" if rel else self.path

    def describe(self, rel: str = "") -> str:
        """``rel`` as the user would name it (for messages)."""
        if self.local:
            return os.path.join(self.path, rel) if rel else self.path
        base = self.url.split("?", 1)[0].rstrip("/")
        return f"{base}/{rel}" if rel else base

    def child(self, rel: str) -> WorkDir:
        """The sub-folder ``rel``, as a WorkDir of its own."""
        if self.local:
            return WorkDir(os.path.join(self.path, rel))
        base, sep, query = self.url.partition("?")
        return WorkDir(f"{base.rstrip('/')}/{rel}{sep}{query}")

    # --- looking -----------------------------------------------------------------------------

    def _info(self, rel: str) -> pafs.FileInfo:
        return self.fs.get_file_info(self.full(rel))

    def exists(self, rel: str = "") -> bool:
        """Whether a file or folder ``rel`` exists."""
        return self._info(rel).type != pafs.FileType.NotFound

    def is_dir(self, rel: str = "") -> bool:
        """Whether ``rel`` is a folder (on an object store: a prefix holding objects)."""
        return self._info(rel).type == pafs.FileType.Directory

    def is_file(self, rel: str = "") -> bool:
        return self._info(rel).type == pafs.FileType.File

    def listdir(self, rel: str = "") -> list[str]:
        """Names (not paths) of the entries of folder ``rel``, sorted; ``[]`` when it is missing."""
        sel = pafs.FileSelector(self.full(rel), allow_not_found=True, recursive=False)
        return sorted(i.base_name for i in self.fs.get_file_info(sel))

    # --- changing ----------------------------------------------------------------------------

    def makedirs(self, rel: str = "") -> None:
        self.fs.create_dir(self.full(rel), recursive=True)

    def remove(self, rel: str) -> None:
        """Delete file ``rel`` if it exists."""
        try:
            self.fs.delete_file(self.full(rel))
        except FileNotFoundError:
            pass

    def rmtree(self, rel: str = "") -> None:
        """Delete folder ``rel`` and everything in it, if it exists."""
        if self.exists(rel):
            try:
                self.fs.delete_dir(self.full(rel))
            except FileNotFoundError:  # an object store folder without a marker object: its files are gone
                if self.exists(rel):
                    raise

    def write_atomic(self, rel: str, write: Callable[[str, pafs.FileSystem], object]) -> None:
        """Call ``write(path, fs)`` on a hidden temporary name beside ``rel``, then move it to ``rel``.

        A ``write`` that raises leaves nothing (its temporary file is deleted).
        """
        folder, _, name = rel.rpartition("/")
        tmp = f"{folder}/.{name}{_TMP}{uuid.uuid4().hex[:12]}" if folder else f".{name}{_TMP}{uuid.uuid4().hex[:12]}"
        if folder:
            self.makedirs(folder)
        try:
            write(self.full(tmp), self.fs)
            self.fs.move(self.full(tmp), self.full(rel))
        except BaseException:
            self.remove(tmp)
            raise

    def read_json(self, rel: str):
        """The JSON document of file ``rel`` (FileNotFoundError when missing)."""
        with self.fs.open_input_stream(self.full(rel)) as f:
            return json.loads(f.read())

    def write_json(self, rel: str, obj) -> None:
        """Write ``obj`` as indented JSON to file ``rel`` (atomically)."""
        data = json.dumps(obj, indent=1).encode()

        def write(path, fs):
            with fs.open_output_stream(path) as f:
                f.write(data)

        self.write_atomic(rel, write)

    def parquet(self, rel: str) -> pq.ParquetFile:
        """File ``rel`` opened as a ``pyarrow.parquet.ParquetFile``."""
        return pq.ParquetFile(self.fs.open_input_file(self.full(rel)))


def is_temporary(name: str) -> bool:
    """Whether a file name is one of `WorkDir.write_atomic`'s temporary names."""
    return name.startswith(".") and _TMP in name
