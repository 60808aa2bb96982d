"""A job's work folder for partial results: a :class:`~dvidshards.jobs.output.Destination` (so a
writable store) with the few extras jobs need: JSON records and Parquet files read back.

Where it is (``--workdir``, default ``NAME.work`` beside the output) is the rule of
:func:`dvidshards.jobs.output.work_folder`. Every file is written under a hidden temporary name
and renamed when complete (a bucket object appears whole): a failed or killed task leaves no file
under a real name. A WorkDir pickles as its store, so a worker opens it with its own credentials.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import OutputError
from ..stores import is_temporary
from .output import Destination

__all__ = ["WorkDir", "is_temporary"]


class WorkDir(Destination):
    """A folder on this host or in a bucket; names inside it are ``/``-joined.

    ``WorkDir.of("work/")``, ``WorkDir.of("gs://bucket/job")``: OutputError (one line, before
    anything is touched) for a location no job can write to.
    """

    @classmethod
    def of(cls, dest, *, what: str = "work folder") -> WorkDir:
        if isinstance(dest, WorkDir):
            return dest
        return cls(dest.store if isinstance(dest, Destination) else Destination.of(dest, what=what).store)

    def read_json(self, rel: str):
        """The JSON document of file ``rel`` (None when it does not exist); OutputError when it is not JSON."""
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
