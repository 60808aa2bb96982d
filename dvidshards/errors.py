"""The library's exception types: every error dvidshards raises derives from DvidShardsError."""

from __future__ import annotations

__all__ = [
    "BlockDecodeError",
    "ChunkIndexError",
    "DvidShardsError",
    "GeometryWarning",
    "IndexRebuiltWarning",
    "JobError",
    "MappingError",
    "MissingShardError",
    "RemoteReadError",
    "ShardFormatError",
    "SpecError",
]


class DvidShardsError(Exception):
    """Base class of every error raised by dvidshards."""


class BlockDecodeError(DvidShardsError, ValueError):
    """A DVID label block (format §1) is malformed: truncated, inconsistent or out of range."""


class ShardFormatError(DvidShardsError, ValueError):
    """A shard's Arrow IPC data is malformed, truncated or has an unexpected schema."""


class ChunkIndexError(DvidShardsError, ValueError):
    """A chunk index (CSV, JSON footer or consolidated index) is malformed or disagrees with its shard."""


class MissingShardError(DvidShardsError, FileNotFoundError):
    """A shard file (or its index) that the read needs does not exist or cannot be opened."""


class RemoteReadError(DvidShardsError, OSError):
    """A remote byte-range read failed after its retries, or returned fewer bytes than asked."""


class SpecError(DvidShardsError, ValueError):
    """A dataset description (neuroglancer spec, info file, scale choice, source) is invalid."""


class MappingError(DvidShardsError, ValueError):
    """A label mapping given to dvidshards.open cannot be read or is inconsistent."""


class JobError(DvidShardsError, RuntimeError):
    """A whole-export job that did not complete: its failed tasks are named, its partial results
    kept where the message says (for ``--resume``); ``report`` is what the job did, when known."""

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report

    def __reduce__(self):
        return (type(self), (str(self), self.report))


class GeometryWarning(UserWarning):
    """Geometry (shard size, volume size, resolution) was inferred from file names, not given."""


class IndexRebuiltWarning(UserWarning):
    """A shard had no chunk index; it was rebuilt from the records' own chunk columns."""
