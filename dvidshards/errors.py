"""The library's exception types: every error dvidshards raises derives from DvidShardsError."""

from __future__ import annotations

from typing import Any

__all__ = ["BlockDecodeError", "ChunkIndexError", "DvidShardsError", "ForkError", "GeometryWarning",
           "IncompleteScalesWarning", "IndexRebuiltWarning", "JobError", "MappingError", "MissingShardError",
           "NotExportedError", "NotFoundError", "OutputError", "OutputLockedError", "RemoteReadError",
           "ShardFormatError", "SpecError"]


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


class NotExportedError(SpecError):
    """A scale the spec lists but the export does not hold (DVID exports scale 0 only by default): the
    message names the scale and how to make it (``dvidshards downsample``)."""


class NotFoundError(DvidShardsError, LookupError):
    """A label (body or supervoxel) asked for by id is not in the export at that scale; the message
    says what the id is instead when it is known (e.g. a supervoxel of another body)."""


class OutputError(DvidShardsError, OSError):
    """A job's destination cannot be used: an unknown scheme, an unreachable bucket, no permission,
    a full disk, or a folder holding something else. One line naming the path and what to do."""


class OutputLockedError(OutputError):
    """Another job holds the lock on this output; the message names it (host, pid, start time)."""


class MappingError(DvidShardsError, ValueError):
    """A label mapping given to dvidshards.open cannot be read or is inconsistent."""


class JobError(DvidShardsError, RuntimeError):
    """A whole-export job that did not complete: its failed tasks are named, its partial results
    kept where the message says (for ``--resume``); ``report`` is what the job did, when known."""

    def __init__(self, message: str, report: Any = None) -> None:
        super().__init__(message)
        self.report = report

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.report))


class ForkError(DvidShardsError, RuntimeError):
    """TensorStore was used in a process forked after TensorStore had started in its parent (use the
    ``spawn`` start method)."""


class GeometryWarning(UserWarning):
    """Geometry (shard size, volume size, resolution) was inferred from file names, not given."""


class IndexRebuiltWarning(UserWarning):
    """A shard had no chunk index; it was rebuilt from the records' own chunk columns."""


class IncompleteScalesWarning(UserWarning):
    """A downsample destination's manifest says its scales are not complete (a job still running, or
    stopped): chunks of its unfinished shards are missing."""
