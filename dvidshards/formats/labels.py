"""Label sources: which ids a read returns, as typed objects.

A DVID record carries two parallel lists, one entry per label of its block: the supervoxels
(the block's own label list) and the agglomerated bodies.  A read swaps the block's palette
for one of them, so the choice costs nothing per voxel:

* ``Agglomerated()`` — the record's ``labels`` list (the bodies at export time);
* ``Supervoxels()`` — the block's own list (the supervoxel ids);
* ``Mapped(mapping)`` — a newer supervoxel → body mapping applied to the supervoxel list.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from ..errors import MappingError, SpecError
from .mapping import LabelMapping

if TYPE_CHECKING:
    from .records import RecordTable

__all__ = ["Agglomerated", "LabelSource", "Mapped", "Supervoxels", "as_labels"]


class LabelSource:
    """What a read writes for each voxel; ``palette`` gives one record's palette."""

    name = ""

    def palette(self, table: RecordTable, i: int) -> np.ndarray | None:
        """The uint64 palette for record i (None: the block's own label list)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self))


class Agglomerated(LabelSource):
    """The records' agglomerated ``labels`` lists (bodies as exported)."""

    name = "agglomerated"

    def palette(self, table: RecordTable, i: int) -> np.ndarray:
        return table.labels(i)


class Supervoxels(LabelSource):
    """The supervoxel ids (each block's own label list)."""

    name = "supervoxels"

    def palette(self, table: RecordTable, i: int) -> None:
        return None


class Mapped(LabelSource):
    """A supervoxel → body mapping applied at read time; unmapped supervoxels keep their id."""

    name = "mapped"

    def __init__(self, mapping):
        self.mapping = LabelMapping.from_any(mapping)

    def palette(self, table: RecordTable, i: int) -> np.ndarray:
        return self.mapping.palette(table.supervoxels(i))

    def __repr__(self) -> str:
        return f"Mapped({self.mapping!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapped) and other.mapping is self.mapping

    def __hash__(self) -> int:
        return id(self.mapping)


def as_labels(labels) -> LabelSource:
    """A LabelSource from ``"agglomerated"``, ``"supervoxels"``, a LabelSource or a mapping.

    A mapping is a LabelMapping, dict, (n, 2) array, pandas Series or the path of a mapping
    file (DVID's ``/mappings`` text, or binary uint64 pairs).
    """
    if isinstance(labels, LabelSource):
        return labels
    if isinstance(labels, str) and labels in ("agglomerated", "supervoxels"):
        return Agglomerated() if labels == "agglomerated" else Supervoxels()
    if isinstance(labels, (str, os.PathLike)):
        path = os.fspath(labels)
        if not os.path.exists(path):
            if os.sep in path or "." in os.path.basename(path):
                raise MappingError(f"{path}: mapping file not found")
            raise SpecError(f"labels={path!r}: give 'agglomerated', 'supervoxels', a mapping file or a "
                            f"mapping (dict, (n, 2) array, pandas Series, LabelMapping)")
    return Mapped(labels)
