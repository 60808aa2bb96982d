"""Label sources: which ids a read returns, as typed objects.

A record carries two lists, one entry per label of its block: the supervoxels (the block's own
list) and the agglomerated bodies; a read swaps the block's palette for one of them, free per
voxel: `Agglomerated` (the record's ``labels``, bodies at export time), `Supervoxels`, or
`Mapped` (a newer supervoxel → body mapping over the supervoxel list). Jobs put label sources in
their tasks, so each names itself in a small dict (`LabelSource.identity`) and pickles small: a
mapping file as its path and change stamp, loaded once per process on first use (a task run
after the file changed fails with `MappingError`); a mapping object by value (16 bytes per
supervoxel in every task).
"""

from __future__ import annotations

import hashlib
from typing import Any, Protocol

import numpy as np

from ..errors import MappingError, SpecError
from .mapping import (
    LabelMapping,
    as_path,
    check_format,
    file_stamp,
    installed_files,
    is_path,
    load_file,
    prepare_file,
)


class RecordTableLike(Protocol):
    """What a label source reads of a `formats.records.RecordTable` (not imported: records uses
    the label sources)."""

    def labels(self, i: int) -> np.ndarray: ...

    def supervoxels(self, i: int) -> np.ndarray: ...

__all__ = ["Agglomerated", "LabelSource", "Mapped", "Supervoxels", "as_labels"]


class LabelSource:
    """What a read writes for each voxel; ``palette`` gives one record's palette."""

    name = ""

    def palette(self, table: RecordTableLike, i: int) -> np.ndarray | None:
        """The uint64 palette for record i (None: the block's own label list)."""
        raise NotImplementedError

    def identity(self) -> dict[str, Any]:
        """What identifies this source in job metadata (JSON-able, cheap to compute)."""
        return {"labels": self.name}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: Any) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self))


class Agglomerated(LabelSource):
    """The records' agglomerated ``labels`` lists (bodies as exported)."""

    name = "agglomerated"

    def palette(self, table: RecordTableLike, i: int) -> np.ndarray:
        return table.labels(i)


class Supervoxels(LabelSource):
    """The supervoxel ids (each block's own label list)."""

    name = "supervoxels"

    def palette(self, table: RecordTableLike, i: int) -> None:
        return None


class Mapped(LabelSource):
    """A supervoxel → body mapping applied at read time; unmapped supervoxels keep their id.

    Parameters
    ----------
    mapping : path, LabelMapping, dict, (n, 2) array_like or pandas.Series
        A mapping file (DVID's ``/mappings`` text or binary pairs) or a mapping object.
    format : {"auto", "text", "binary"}
        Of a mapping file (`LabelMapping.from_file`).

    Notes
    -----
    A file is only stamped (size, modification time) here and loaded on first use in each
    process (or by `load`); it pickles as (path, stamp), and a process finding it changed raises
    `MappingError`. A mapping object is built now and pickles by value.
    """

    name = "mapped"

    def __init__(self, mapping: Any, *, format: str = "auto") -> None:
        self._mapping: LabelMapping | None = None
        self.path: str | None = None
        self.stamp: tuple[int, int] | None = None
        self.format = format
        if is_path(mapping):
            check_format(format)
            self.path = installed_files().absolute(as_path(mapping))
            self.stamp = file_stamp(self.path)
        else:
            self._mapping = LabelMapping.from_any(mapping)

    @property
    def mapping(self) -> LabelMapping:
        """The mapping (a file's loaded on first use, once per process)."""
        m = self._mapping
        if m is None:
            assert self.path is not None and self.stamp is not None
            m = self._mapping = load_file(self.path, self.stamp, self.format)
        return m

    def load(self) -> LabelMapping:
        """Load the mapping now (a bad file raises here rather than in a read)."""
        return self.mapping

    def prepare(self) -> None:
        """For a job's client: check a mapping file and build its per-host sidecar without holding the
        mapping here (`formats.mapping.prepare_file`)."""
        if self.path is not None and self._mapping is None:
            prepare_file(self.path, self.stamp, self.format)

    def palette(self, table: RecordTableLike, i: int) -> np.ndarray:
        return self.mapping.palette(table.supervoxels(i))

    def identity(self) -> dict[str, Any]:
        """A file by path and stamp (nothing read); an object by its content's SHA-256."""
        if self.path is not None:
            assert self.stamp is not None
            return {"labels": "mapped", "mapping_file": self.path, "mapping_bytes": self.stamp[0],
                    "mapping_mtime_ns": self.stamp[1], "mapping_format": self.format}
        m = self.mapping
        h = hashlib.sha256(np.ascontiguousarray(m.keys).tobytes())
        h.update(np.ascontiguousarray(m.values).tobytes())
        return {"labels": "mapped", "mapping_sha256": h.hexdigest(), "mapping_size": len(m)}

    def __getstate__(self) -> Any:
        if self.path is not None:  # by reference: loaded again in the process that runs the task
            return {"path": self.path, "stamp": self.stamp, "format": self.format}
        return {"mapping": self._mapping}

    def __setstate__(self, state: Any) -> None:
        self._mapping = state.get("mapping")
        self.path = state.get("path")
        self.stamp = tuple(state["stamp"]) if state.get("stamp") is not None else None
        self.format = state.get("format", "auto")

    def __repr__(self) -> str:
        if self.path is not None:
            return f"Mapped({self.path!r})"
        return f"Mapped({self._mapping!r})"

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, Mapped):
            return False
        if self.path is not None:
            return (other.path, other.stamp, other.format) == (self.path, self.stamp, self.format)
        return other.path is None and other._mapping is self._mapping

    def __hash__(self) -> int:
        if self.path is not None:
            return hash((self.path, self.stamp, self.format))
        return id(self._mapping)


def as_labels(labels: Any) -> LabelSource:
    """A LabelSource from ``"agglomerated"``, ``"supervoxels"``, a LabelSource or a mapping (object,
    or a file's path: stamped now, a missing one raises, loaded on first use)."""
    if isinstance(labels, LabelSource):
        return labels
    if isinstance(labels, str) and labels in ("agglomerated", "supervoxels"):
        return Agglomerated() if labels == "agglomerated" else Supervoxels()
    if is_path(labels):
        path = as_path(labels)
        if not installed_files().exists(path):
            if "/" in path or "\\" in path or "." in path.rsplit("/", 1)[-1]:
                raise MappingError(f"{path}: mapping file not found")
            raise SpecError(f"labels={path!r}: give 'agglomerated', 'supervoxels', a mapping file or a "
                            f"mapping (dict, (n, 2) array, pandas Series, LabelMapping)")
    return Mapped(labels)

