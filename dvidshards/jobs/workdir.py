"""A job's work folder for partial results: a path or a bucket, on the one output I/O stack.

Whole-export jobs keep what their tasks wrote in a *work folder* that every worker reaches (a
local folder for threads and a ``LocalCluster``; a shared file system or a bucket on a cluster).
`WorkDir` is that folder: a :class:`~dvidshards.jobs.output.Destination` (one parser for paths,
``gs://``, ``s3://``, ``memory://`` and kvstore spec dicts; local files through the operating
system, buckets through TensorStore's kvstore with bounded timeouts) with the few extras jobs
need: JSON records and Parquet files read back.

Every file is written under a hidden temporary name and renamed when complete (a bucket object
appears whole): a failed or killed task leaves no file under a real name. A WorkDir pickles as
its location, so a worker opens it with its own credentials. A local file is opened as a real
file (random access, nothing read ahead); an object in a bucket is read whole.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import OutputError
from .output import Destination, is_temporary

__all__ = ["WorkDir", "is_temporary"]


class WorkDir(Destination):
    """A folder on this host or in a bucket; names inside it are ``/``-joined.

    Use :meth:`of` to make one: ``WorkDir.of("work/")``, ``WorkDir.of("gs://bucket/job")``.

    Raises
    ------
    OutputError
        A location no job can write to (one line, before anything is touched).
    """

    @classmethod
    def of(cls, dest, *, what: str = "work folder") -> WorkDir:
        if isinstance(dest, WorkDir):
            return dest
        d = Destination.of(dest, what=what)
        return cls(d.url, d.spec, d.path)

    def __reduce__(self):
        return (WorkDir, (self.url, self.spec, self.path))

    def __repr__(self) -> str:
        return f"WorkDir({self.url!r})"

    def child(self, rel: str) -> WorkDir:
        d = super().child(rel)
        return WorkDir(d.url, d.spec, d.path)

    def read_json(self, rel: str):
        """The JSON document of file ``rel`` (None when it does not exist).

        Raises
        ------
        OutputError
            The file is there and is not JSON.
        """
        data = self.read(rel)
        if data is None:
            return None
        try:
            return json.loads(data)
        except ValueError as e:
            raise OutputError(f"{self.describe(rel)}: not a JSON document ({' '.join(str(e).split())[:80]})") from None

    def write_json(self, rel: str, obj) -> None:
        """Write ``obj`` as indented JSON to file ``rel`` (atomically)."""
        self.write(rel, (json.dumps(obj, indent=1, default=str) + "\n").encode())

    def read_table(self, rel: str) -> pa.Table:
        """Parquet file ``rel`` read whole (a dataset's bucket file)."""
        with self.open_input(rel) as f:
            try:
                return pq.read_table(f)
            except (OSError, pa.ArrowException) as e:
                raise OutputError(f"{self.describe(rel)}: not a Parquet file ({' '.join(str(e).split())[:120]})") from None
