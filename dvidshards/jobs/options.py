"""The options every job shares: one spelling in Python and one on the command line.

Python: ``job(source, dest, *, scales=None, labels="agglomerated", box=None, scheduler=None,
workdir=None, resume=False, overwrite=False, progress=None, allow_partial=False, ...)``.

Command line, built from the definitions here for every command::

    dvidshards JOB EXPORT DEST [--spec SPEC] [--scales 0 1 2 | --scale K]
               [--labels agglomerated|supervoxels|FILE] [--box X0 Y0 Z0 X1 Y1 Z1]
               [--scheduler WHERE] [--workdir FOLDER] [--resume | --overwrite] [--quiet]

Old spellings keep working for one release, with a warning that names the new one:
``--box x0,y0,z0,x1,y1,z1``, ``--scales 0,1,2``, ``--mapping FILE`` (now ``--labels FILE``),
``--out``/``--to DEST`` (now the positional DEST), and the keywords ``ds=``, ``out=``, ``to=``,
``mapping=`` in Python.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Iterable, Sequence

import numpy as np

from ..errors import SpecError
from .runner import SCHEDULER_HELP

__all__ = [
    "LABELS_HELP",
    "add_box",
    "add_dest",
    "add_job_options",
    "add_labels",
    "add_scale",
    "add_scales",
    "add_source",
    "box_of",
    "dest_of",
    "job_options",
    "renamed",
    "scales_of",
]

LABELS_HELP = "ids written: agglomerated (default), supervoxels, or a mapping file (DVID's text or binary pairs)"


def _say_deprecated(text: str) -> None:
    """On the command line: a warning line on stderr (DeprecationWarnings are hidden by default)."""
    print(f"dvidshards: warning: {text} (the old spelling goes in the next release)", file=sys.stderr)


# --------------------------------------------------------------------------- Python arguments


def renamed(kwargs: dict, old: str, new: str, value, *, job: str):
    """``value`` or, when the caller used the old keyword ``old``, its value (with a
    DeprecationWarning naming ``new``). Pops ``old`` from ``kwargs``."""
    if old not in kwargs:
        return value
    if value is not None:
        raise TypeError(f"{job}() got both {old}= and {new}=; give {new}= only")
    warnings.warn(f"{job}({old}=...) is now {job}({new}=...) (the old keyword goes in the next release)",
                  DeprecationWarning, stacklevel=3)
    return kwargs.pop(old)


def scales_of(scales) -> list[int] | None:
    """``None`` or a sorted list of distinct scale numbers from an int, a sequence or ``"0,1,2"``."""
    if scales is None:
        return None
    parts: list
    if isinstance(scales, str):
        parts = [p for p in scales.replace(",", " ").split() if p]
    elif isinstance(scales, (int, np.integer)):
        parts = [scales]
    else:
        parts = list(scales)
    out = []
    for p in parts:
        try:
            k = int(p)
        except (TypeError, ValueError):
            raise SpecError(f"scales must be whole numbers (0 1 2), got {scales!r}") from None
        if k < 0 or (not isinstance(p, (int, np.integer)) and str(k) != str(p).strip()):
            raise SpecError(f"scales must be whole numbers >= 0, got {scales!r}")
        out.append(k)
    if not out:
        raise SpecError("scales is empty; give at least one scale, or leave it out for all")
    return sorted(set(out))


def box_of(box) -> tuple[tuple[int, int, int], tuple[int, int, int]] | None:
    """``None`` or ``((x0, y0, z0), (x1, y1, z1))`` from ``[[x0, y0, z0], [x1, y1, z1]]``, six
    numbers or ``"x0,y0,z0,x1,y1,z1"``; the box must not be empty."""
    if box is None:
        return None
    if isinstance(box, str):
        vals: Sequence = [v for v in box.replace(",", " ").split() if v]
    else:
        try:
            vals = np.asarray(box).reshape(-1).tolist()
        except (TypeError, ValueError):
            vals = []
    try:
        nums = [int(v) for v in vals]
        if any(float(v) != int(v) for v in vals):
            raise ValueError
    except (TypeError, ValueError):
        nums = []
    if len(nums) != 6:
        raise SpecError(f"box must be six whole numbers X0 Y0 Z0 X1 Y1 Z1, got {box!r}")
    lo, hi = tuple(nums[:3]), tuple(nums[3:])
    if any(a >= b for a, b in zip(lo, hi, strict=True)) or min(lo) < 0:
        raise SpecError(f"box {list(lo)}..{list(hi)} is empty or negative: each X1 must exceed X0 (and so on)")
    return lo, hi  # type: ignore[return-value]


# --------------------------------------------------------------------------- command line


class _Scales(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        values = list(values)
        if any("," in v for v in values):
            _say_deprecated(f"{option_string} {','.join(values)} is now {option_string} "
                            f"{' '.join(v for s in values for v in s.split(',') if v)}")
        try:
            setattr(namespace, self.dest, scales_of(" ".join(values)))
        except SpecError as e:
            parser.error(str(e))


class _Box(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        values = list(values)
        if len(values) == 1 and "," in values[0]:
            _say_deprecated(f"--box {values[0]} is now --box {values[0].replace(',', ' ')}")
        elif len(values) != 6:
            parser.error(f"--box takes six numbers X0 Y0 Z0 X1 Y1 Z1, got {len(values)}")
        try:
            setattr(namespace, self.dest, box_of(" ".join(values)))
        except SpecError as e:
            parser.error(str(e))


class _Renamed(argparse.Action):
    """An old option that now has another name: stores into the new one's destination, with a warning."""

    def __init__(self, *args, new: str = "", **kwargs):
        self.new = new
        super().__init__(*args, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        _say_deprecated(f"{option_string} {values} is now {self.new}")
        setattr(namespace, self.dest, values)


def add_source(p, *, spec: bool = True) -> None:
    """``EXPORT`` (and ``--spec``)."""
    p.add_argument("source", metavar="EXPORT",
                   help="the export: a folder, gs://, s3://, http(s):// URL, or a downsample output (its source "
                        "is read with it)")
    if spec:
        p.add_argument("--spec", help="the neuroglancer multiscale spec given to DVID's export-shards "
                                      "(default: the export's info, else inferred from the files)")


def add_dest(p, *, what: str, old: Sequence[str] = ("--out",), required: bool = True) -> None:
    """The positional ``DEST`` (and its old ``--out``/``--to`` spelling, deprecated)."""
    p.add_argument("dest", metavar="DEST", nargs=None if not old else "?",
                   help=f"{what}: a folder, gs:// or s3:// (written there or refused before any work)")
    for flag in old:
        p.add_argument(flag, dest="_old_dest", metavar="DEST", action=_Renamed, new="the positional DEST",
                       help=argparse.SUPPRESS)
    p.set_defaults(_dest_required=required)


def dest_of(args) -> str | None:
    """The destination from ``DEST`` or its old option; a usage error when neither or both."""
    new, old = getattr(args, "dest", None), getattr(args, "_old_dest", None)
    if new is not None and old is not None and new != old:
        raise SpecError(f"give the destination once (DEST {new!r} and the old option {old!r})")
    d = new if new is not None else old
    if d is None and getattr(args, "_dest_required", True):
        raise SpecError("give a destination: dvidshards COMMAND EXPORT DEST")
    return d


def add_scales(p, *, help: str = "scales to work on (default: every scale the export holds)") -> None:  # noqa: A002
    """``--scales 0 1 2`` (``0,1,2`` accepted, deprecated)."""
    p.add_argument("--scales", nargs="+", action=_Scales, default=None, metavar="K", help=help)


def add_scale(p, *, default: int | None = 0) -> None:
    """``--scale K`` for jobs that work on one scale."""
    p.add_argument("--scale", type=int, default=default, metavar="K",
                   help=f"scale K (folder sK){'' if default is None else f'; default {default}'}")


def add_labels(p, *, default: str = "agglomerated", old: bool = False) -> None:
    """``--labels agglomerated|supervoxels|FILE`` (and the old ``--mapping FILE``, deprecated)."""
    p.add_argument("--labels", default=default, metavar="LABELS", help=LABELS_HELP)
    if old:
        p.add_argument("--mapping", dest="labels", action=_Renamed, new="--labels FILE", help=argparse.SUPPRESS)


def add_box(p, *, help: str = "only voxels in the box X0 Y0 Z0 X1 Y1 Z1 (voxels at the scale worked on)") -> None:  # noqa: A002
    """``--box X0 Y0 Z0 X1 Y1 Z1`` (``x0,y0,z0,x1,y1,z1`` accepted, deprecated)."""
    p.add_argument("--box", nargs="+", action=_Box, default=None, metavar="N", help=help)


def add_job_options(p, *, workdir: bool = True) -> None:
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


def job_options(args, *, workdir: bool = True) -> dict:
    """The keyword arguments of a job's Python function from its parsed shared options."""
    kw = {"scheduler": args.scheduler, "resume": args.resume, "overwrite": args.overwrite,
          "progress": False if getattr(args, "quiet", False) else None}
    if workdir:
        kw["workdir"] = getattr(args, "workdir", None)
    return kw


def command_line(job: str, args, skip: Iterable[str] = ()) -> str:
    """The command as given (options at their defaults left out), for the manifest."""
    import shlex

    words = ["dvidshards", job]
    hidden = {"command", "quiet", "source", "dest", *skip}
    if getattr(args, "source", None) is not None:
        words += [str(s) for s in (args.source if isinstance(args.source, list) else [args.source])]
    d = getattr(args, "dest", None) or getattr(args, "_old_dest", None)
    if d is not None:
        words.append(str(d))
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
