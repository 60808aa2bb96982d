"""The options every job shares: one spelling in Python and one on the command line.

Python: ``job(source, dest, *, scales=None, labels="agglomerated", box=None, scheduler=None,
workdir=None, resume=False, overwrite=False, progress=None, allow_partial=False, ...)``.

Command line, built from the definitions here for every command::

    dvidshards JOB EXPORT DEST [--spec SPEC] [--scales 0 1 2 | --scale K]
               [--labels agglomerated|supervoxels|FILE] [--box X0 Y0 Z0 X1 Y1 Z1]
               [--scheduler WHERE] [--workdir FOLDER] [--resume | --overwrite] [--quiet]
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..errors import SpecError
from .runner import SCHEDULER_HELP

__all__ = ["LABELS_HELP", "add_box", "add_dest", "add_job_options", "add_labels", "add_scale", "add_scales",
           "add_source", "box_of", "command_line", "job_options", "scales_of"]

LABELS_HELP = "ids written: agglomerated (default), supervoxels, or a mapping file (DVID's text or binary pairs)"


# --------------------------------------------------------------------------- Python arguments


def scales_of(scales: Any) -> list[int] | None:
    """``None``, or the sorted distinct scale numbers of an int or a sequence of them."""
    if scales is None:
        return None
    parts = [scales] if isinstance(scales, (int, np.integer, str)) else list(scales)
    out = []
    for p in parts:
        try:
            k = int(p) if not isinstance(p, (bool, float)) and str(p).strip().isdigit() else -1
        except (TypeError, ValueError):
            k = -1
        if k < 0:
            raise SpecError(f"scales must be whole numbers >= 0 (0 1 2), got {scales!r}")
        out.append(k)
    if not out:
        raise SpecError("scales is empty; give at least one scale, or leave it out for all")
    return sorted(set(out))


def box_of(box: Any) -> tuple[tuple[int, int, int], tuple[int, int, int]] | None:
    """``None``, or ``((x0, y0, z0), (x1, y1, z1))`` of ``[[x0, y0, z0], [x1, y1, z1]]`` or six
    numbers (not empty)."""
    if box is None:
        return None
    try:
        vals = [] if isinstance(box, str) else np.asarray(box).reshape(-1).tolist()
        nums = [int(v) for v in vals]
        if any(float(v) != int(v) for v in vals):
            raise ValueError
    except (TypeError, ValueError):
        nums = []
    if len(nums) != 6:
        raise SpecError(f"box must be six whole numbers X0 Y0 Z0 X1 Y1 Z1, got {box!r}")
    lo, hi = (nums[0], nums[1], nums[2]), (nums[3], nums[4], nums[5])
    if any(a >= b for a, b in zip(lo, hi, strict=True)) or min(lo) < 0:
        raise SpecError(f"box {list(lo)}..{list(hi)} is empty or negative: each X1 must exceed X0 (and so on)")
    return lo, hi


# --------------------------------------------------------------------------- command line


class _Scales(argparse.Action):
    def __call__(self, parser: Any, namespace: Any, values: Any, _option: str | None = None) -> None:
        try:
            setattr(namespace, self.dest, scales_of(list(values)))
        except SpecError as e:
            parser.error(str(e))


class _Box(argparse.Action):
    def __call__(self, parser: Any, namespace: Any, values: Any, _option: str | None = None) -> None:
        if len(values) != 6:
            parser.error(f"--box takes six numbers X0 Y0 Z0 X1 Y1 Z1, got {len(values)}")
        try:
            setattr(namespace, self.dest, box_of([float(v) if "." in v else int(v) for v in values]))
        except (SpecError, ValueError) as e:
            parser.error(str(e) if isinstance(e, SpecError) else f"--box takes six whole numbers, got {values}")


def add_source(p: Any, *, spec: bool = True) -> None:
    """``EXPORT`` (and ``--spec``)."""
    p.add_argument("source", metavar="EXPORT",
                   help="the export: a folder, gs://, s3://, http(s):// URL, or a downsample output (its source "
                        "is read with it)")
    if spec:
        p.add_argument("--spec", help="the neuroglancer multiscale spec given to DVID's export-shards "
                                      "(default: the export's info, else inferred from the files)")


def add_dest(p: Any, *, what: str, required: bool = True) -> None:
    """The positional ``DEST``."""
    p.add_argument("dest", metavar="DEST", nargs=None if required else "?",
                   help=f"{what}: a folder, gs:// or s3:// (written there or refused before any work)")


def add_scales(p: Any, *, help: str = "scales to work on (default: every scale the export holds)") -> None:  # noqa: A002
    """``--scales 0 1 2``."""
    p.add_argument("--scales", nargs="+", action=_Scales, default=None, metavar="K", help=help)


def add_scale(p: Any, *, default: int | None = 0) -> None:
    """``--scale K``."""
    p.add_argument("--scale", type=int, default=default, metavar="K",
                   help=f"scale K (folder sK){'' if default is None else f'; default {default}'}")


def add_labels(p: Any, *, default: str = "agglomerated") -> None:
    """``--labels agglomerated|supervoxels|FILE``."""
    p.add_argument("--labels", default=default, metavar="LABELS", help=LABELS_HELP)


def add_box(p: Any, *, help: str = "only voxels in the box X0 Y0 Z0 X1 Y1 Z1 (voxels at the scale worked on)") -> None:  # noqa: A002
    """``--box X0 Y0 Z0 X1 Y1 Z1``."""
    p.add_argument("--box", nargs="+", action=_Box, default=None, metavar="N", help=help)


def add_job_options(p: Any, *, workdir: bool = True) -> None:
    """``--scheduler``, ``--workdir``, ``--resume``, ``--overwrite``, ``--quiet``."""
    p.add_argument("--scheduler", default=None, metavar="WHERE", help=SCHEDULER_HELP)
    if workdir:
        p.add_argument("--workdir", default=None, metavar="FOLDER",
                       help="folder for partial results, visible to every worker (a shared file system or a "
                            "bucket on a cluster); default: beside the output")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true",
                   help="finish an interrupted run (same arguments): keep what it completed")
    g.add_argument("--overwrite", action="store_true",
                   help="replace this job's earlier output (default: refuse a destination that is not empty)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or progress lines")


def job_options(args: Any, *, workdir: bool = True) -> dict:
    """A job function's keyword arguments of the shared options parsed."""
    kw = {"scheduler": args.scheduler, "resume": args.resume, "overwrite": args.overwrite,
          "progress": False if getattr(args, "quiet", False) else None}
    if workdir:
        kw["workdir"] = getattr(args, "workdir", None)
    return kw


def command_line(job: str, args: Any, skip: Iterable[str] = ()) -> str:
    """The command as given, options at their defaults left out (for the manifest)."""
    words = ["dvidshards", job]
    hidden = {"command", "quiet", "source", "dest", *skip}
    if getattr(args, "source", None) is not None:
        words += [str(s) for s in (args.source if isinstance(args.source, list) else [args.source])]
    if getattr(args, "dest", None) is not None:
        words.append(str(args.dest))
    for name, value in vars(args).items():
        if name in hidden or name.startswith("_") or value in (None, False):
            continue
        flag = "--" + name.replace("_", "-")
        if value is True:
            words.append(flag)
        elif isinstance(value, (list, tuple)):
            flat = [v for x in value for v in (x if isinstance(x, (list, tuple)) else [x])]
            words += [flag, *map(str, flat)]
        else:
            words += [flag, str(value)]
    return shlex.join(words)
