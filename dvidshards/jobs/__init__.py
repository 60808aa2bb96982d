"""Whole-export jobs: plan → tasks → reduce, run serially, on threads or on dask.

Every job is here by name, imported on first use (``from dvidshards.jobs import convert`` is the
function; its module is ``dvidshards.jobs.convert`` in ``sys.modules``):

* ``convert`` - neuroglancer precomputed or zarr v3          * ``downsample`` - the scales an export lacks
* ``body_stats`` / ``label_index`` - per-body statistics, DVID's label index
* ``meshes`` - multi-resolution meshes of every body          * ``skeletons`` - a skeleton of every body
* ``pcg_edges`` - PyChunkedGraph edges and components        * ``ingest`` - records into a sorted table
* ``verify`` - an export or any job's output checked end to end

They stand on ``output`` (where every job writes: store, lock, manifest, ``JobReport``, the failure
contract), ``runner`` (``TaskRunner``: serial, threads or dask, retries), ``options`` (the options
every job shares) and ``readback`` (an output scale read back and spot-checked).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

#: every name this package exports, and the module that holds it
_EXPORTS = {"convert": "convert", "body_stats": "stats", "label_index": "labelindex", "downsample": "downsample",
            "meshes": "meshes", "pcg_edges": "pcg", "ingest": "ingest", "verify": "verify", "skeletons": "skeletons",
            "VerifyReport": "verify", "JobReport": "output", "Output": "output", "read_manifest": "output",
            "PhaseReport": "runner", "TaskRunner": "runner", "describe_exception": "runner", "run_tasks": "runner"}

__all__ = sorted(_EXPORTS)


class _Jobs(types.ModuleType):
    """This package: a job's name is its function even once its module of the same name is imported
    (importing ``dvidshards.jobs.convert`` sets the attribute ``convert`` of the package to the module)."""

    def __getattribute__(self, name: str) -> Any:
        where = _EXPORTS.get(name)
        if where is None:
            return super().__getattribute__(name)
        return getattr(importlib.import_module(f"{__name__}.{where}"), name)

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *_EXPORTS})


sys.modules[__name__].__class__ = _Jobs
