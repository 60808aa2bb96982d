"""Whole-export jobs: one task per shard (or per bucket), run serially or on dask.

* ``runner``     - `run_tasks`: the task runner every job uses (serial, threads or dask)
* ``stats``      - per-body statistics and DVID's label index (map, tree reduce, buckets)
* ``convert``    - neuroglancer precomputed or zarr v3, one task per output shard
* ``pcg``        - PyChunkedGraph edges and components
* ``verify``     - every index row, record, checksum and block checked
* ``ingest``     - records into a sorted table; DVID /blocks dumps into an export

Each job module holds what one task does and how the export is cut into tasks; the command
line of each job (``add_arguments``/``main``) sits at the end of its module.
"""

from __future__ import annotations

from .runner import JobReport, describe_exception, run_tasks

__all__ = ["JobReport", "describe_exception", "run_tasks"]
