"""Whole-export jobs: plan → tasks → reduce, run serially, on threads or on dask.

* ``output``     - where every job writes: destination, lock, manifest, report, failure contract
* ``runner``     - `TaskRunner`: where tasks run (serial, threads or dask)
* ``options``    - the options every job shares, in Python and on the command line
* ``workdir``    - a job's work folder for partial results (a path or a bucket)
* ``readback``   - an output scale opened and spot-checked against the source
* ``stats``      - per-body statistics and DVID's label index (map, tree reduce, buckets)
* ``convert``    - neuroglancer precomputed or zarr v3, one task per source shard
* ``downsample`` - the scales an export lacks, made the way DVID makes its pyramid
* ``meshes``     - multi-resolution meshes of every body
* ``pcg``        - PyChunkedGraph edges and components
* ``verify``     - every index row, record, checksum and block checked; any job's manifest read
* ``ingest``     - records into a sorted table; DVID /blocks dumps into an export

Each job module holds how the export is cut into tasks, what one task does and how results
merge; its command line (``add_arguments``/``main``) sits at the end of its module.
"""

from __future__ import annotations

from .output import Destination, JobReport, Output, read_manifest
from .runner import PhaseReport, TaskRunner, describe_exception, run_tasks

__all__ = ["Destination", "JobReport", "Output", "PhaseReport", "TaskRunner", "describe_exception", "read_manifest",
           "run_tasks"]
