"""dvidshards: read DVID export-shards segmentation exports as TensorStore volumes."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

from .bodies import Body
from .dataset import Dataset, Scale, open
from .errors import (
    BlockDecodeError,
    ChunkIndexError,
    DvidShardsError,
    GeometryWarning,
    IndexRebuiltWarning,
    JobError,
    MappingError,
    MissingShardError,
    RemoteReadError,
    ShardFormatError,
    SpecError,
)
from .formats.codec import BlockHeader, block_header, decode_block, encode_block
from .formats.labels import Agglomerated, Mapped, Supervoxels
from .formats.mapping import LabelMapping
from .jobs.verify import VerifyReport, verify
from .writer import write_export, write_shard

__all__ = [
    "Agglomerated",
    "Body",
    "BlockDecodeError",
    "BlockHeader",
    "ChunkIndexError",
    "Dataset",
    "DvidShardsError",
    "GeometryWarning",
    "IndexRebuiltWarning",
    "JobError",
    "LabelMapping",
    "Mapped",
    "MappingError",
    "MissingShardError",
    "RemoteReadError",
    "Scale",
    "ShardFormatError",
    "SpecError",
    "Supervoxels",
    "VerifyReport",
    "block_header",
    "decode_block",
    "encode_block",
    "open",
    "verify",
    "write_export",
    "write_shard",
]

__version__ = "0.1.0"

# --- deprecated names (0.1 -> 0.2): removed in the release after this one ---------------------

#: old module -> the modules that now hold its names (looked up in this order)
_MOVED = {
    "stats": ("jobs.stats", "formats.labelindex", "formats.records"),
    "convert": ("jobs.convert",),
    "pcg": ("jobs.pcg",),
    "verify": ("jobs.verify",),
    "view": ("serve.view",),
    "flight": ("sources.flight", "serve.flight", "sources", "jobs.ingest"),
    "tables": ("sources.tables", "sources.vastdb", "jobs.ingest"),
}


class _MovedModule(types.ModuleType):
    def __getattr__(self, name: str):
        old = self.__name__
        if name.startswith("__"):  # module machinery (inspect, pickle) asks for these
            raise AttributeError(name)
        for new in _MOVED[old.rpartition(".")[2]]:
            mod = importlib.import_module(f"{__name__}.{new}")
            if hasattr(mod, name):
                warnings.warn(f"{old}.{name} is deprecated: use {__name__}.{new}.{name} (the old module "
                              f"path goes in the next release)", DeprecationWarning, stacklevel=2)
                return getattr(mod, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r}")


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of the old module paths give a module that forwards to the new ones, with a warning."""

    def find_spec(self, fullname, path=None, target=None):
        pkg, _, leaf = fullname.rpartition(".")
        if pkg == __name__ and leaf in _MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return _MovedModule(spec.name)

    def exec_module(self, module) -> None:
        pass


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedFinder())


def _viewer(self, labels="agglomerated", select=None, position=None, **kwargs):
    """Deprecated: ``dvidshards.serve.view.viewer(ds, ...)``."""
    warnings.warn("Dataset.viewer is deprecated: use dvidshards.serve.view.viewer(ds, ...) (goes in the next "
                  "release)", DeprecationWarning, stacklevel=2)
    from .serve.view import viewer

    return viewer(self, labels=labels, select=select, position=position, **kwargs)


Dataset.viewer = _viewer  # type: ignore[attr-defined]  # the package root wires the deprecated alias

