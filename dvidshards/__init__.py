"""dvidshards: read DVID export-shards segmentation exports as TensorStore volumes."""

from __future__ import annotations

from .formats.codec import BlockHeader, block_header, decode_block, encode_block
from .dataset import Dataset, Scale
from .errors import (
    BlockDecodeError,
    ChunkIndexError,
    DvidShardsError,
    MappingError,
    MissingShardError,
    RemoteReadError,
    ShardFormatError,
    SpecError,
)
from .formats.mapping import LabelMapping
from .verify import VerifyReport, verify
from .volume import open
from .writer import write_export, write_shard

__all__ = [
    "BlockDecodeError",
    "BlockHeader",
    "ChunkIndexError",
    "Dataset",
    "DvidShardsError",
    "LabelMapping",
    "MappingError",
    "MissingShardError",
    "RemoteReadError",
    "Scale",
    "ShardFormatError",
    "SpecError",
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
