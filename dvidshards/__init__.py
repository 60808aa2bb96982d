"""dvidshards: read DVID export-shards exports as TensorStore volumes."""

from __future__ import annotations

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
