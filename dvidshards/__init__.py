"""dvidshards: read DVID export-shards segmentation exports as TensorStore volumes."""

from __future__ import annotations

from . import runtime  # noqa: F401 - installs the kernel compiler, the mapping-file cache and the fork guard
from .bodies import Body
from .dataset import Dataset, Scale, open
from .errors import (
    BlockDecodeError,
    ChunkIndexError,
    DvidShardsError,
    ForkError,
    GeometryWarning,
    IncompleteScalesWarning,
    IndexRebuiltWarning,
    JobError,
    MappingError,
    MissingShardError,
    NotExportedError,
    NotFoundError,
    OutputError,
    OutputLockedError,
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
    "ForkError",
    "GeometryWarning",
    "IncompleteScalesWarning",
    "IndexRebuiltWarning",
    "JobError",
    "LabelMapping",
    "Mapped",
    "MappingError",
    "MissingShardError",
    "NotExportedError",
    "NotFoundError",
    "OutputError",
    "OutputLockedError",
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
