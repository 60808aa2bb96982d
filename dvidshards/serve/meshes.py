"""The body meshes and skeletons ``view`` and ``serve-dvid`` serve, read from a ``dvidshards meshes``
or ``skeletons`` output or made on demand, made once however many requests ask at the same time
and kept (least recently used dropped first).

Meshes are neuroglancer's legacy mesh of a body (float32 nm):

- From an output (a folder or a bucket): the legacy format's fragments joined; the
  multi-resolution format's finest level (sharded or one file pair per body), Draco-decoded and
  placed by its ``transform``.
- On demand: ``Body.mesh`` at the finest held scale expected to take under ``budget`` seconds
  (the cost per cell is learned as meshes are made); the label index, when given, finds the
  body's chunks without scanning the records' lists.

Skeletons (`dvidshards.formats.skeleton.Skeleton`: nm, radii) come from the output
(``jobs.skeletons.SkeletonOutput``), or are made on demand as the ``skeletons`` job makes them
(``Body.skeleton``) at the job's scale: the finest of at least 32 nm the export holds (or, in
serve-dvid, makes).
"""

from __future__ import annotations

import gzip
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

import numpy as np

from ..bodies import Body
from ..errors import NotFoundError, SpecError
from ..formats.labels import as_labels
from ..formats.mesh import Mesh, merge_fragments, to_nm
from ..formats.multilod import (
    LEGACY_TYPE,
    MULTILOD_TYPE,
    decode_legacy_fragment,
    decode_manifest,
    decode_object,
    encode_legacy_fragment,
)
from ..formats.sharding import ShardingSpec, shard_key, shard_of_key
from ..formats.skeleton import Skeleton
from ..jobs.output import read_manifest
from ..query import BodyIndex, held_scales
from ..stores import as_store

__all__ = ["Cache", "MeshOutput", "MeshSource", "SkeletonSource"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class Cache(Generic[T]):
    """Values by body id: made once (one caller makes them, the others wait), kept up to
    ``cache_bytes`` (``size(value)`` each), least recently used dropped first."""

    def __init__(self, make: Callable[[int], T], size: Callable[[T], int], cache_bytes: int):
        self.make, self.cache_bytes, self.size = make, int(cache_bytes), size
        self._kept: OrderedDict[int, T] = OrderedDict()
        self._bytes = 0
        self._busy: dict[int, threading.Event] = {}
        self._lock = threading.Lock()

    def __contains__(self, body: int) -> bool:
        return body in self._kept

    def get(self, body: int) -> T:
        while True:
            with self._lock:
                data = self._kept.get(body)
                if data is not None:
                    self._kept.move_to_end(body)
                    return data
                ev = self._busy.get(body)
                if ev is None:
                    ev = self._busy[body] = threading.Event()
                    break
            ev.wait()
        try:
            data = self.make(body)
            with self._lock:
                self._kept[body] = data
                self._bytes += self.size(data)
                while self._bytes > self.cache_bytes and len(self._kept) > 1:
                    self._bytes -= self.size(self._kept.popitem(last=False)[1])
            return data
        finally:
            with self._lock:
                self._busy.pop(body, None)
            ev.set()


class MeshOutput:
    """The mesh directory of a ``dvidshards meshes`` output on any store (``location``: the output,
    whose ``info`` names it, or the directory); SpecError when it is none, or is incomplete."""

    def __init__(self, location):
        root = as_store(location, what="meshes output")
        info = _json(root, "info", location)
        if isinstance(info, dict) and isinstance(info.get("mesh"), str):
            root = root.child(info["mesh"].strip("/") + "/")
            info = _json(root, "info", location)
        if not (isinstance(info, dict) and info.get("@type") in (MULTILOD_TYPE, LEGACY_TYPE)):
            raise SpecError(f"{location}: not a meshes output (no info of a precomputed dataset with meshes or of a "
                            f"mesh folder)")
        manifest = read_manifest(root)
        if manifest is not None and not manifest.get("complete", False):
            raise SpecError(f"{root.describe('')}: the meshes output is incomplete (run dvidshards meshes --resume)")
        self.store, self.info = root, info
        self.legacy = info["@type"] == LEGACY_TYPE
        self.folder = root.local_path()  # view serves a local output's files as they are
        self.sharding = ShardingSpec.from_json(info["sharding"]) if "sharding" in info else None

    def __repr__(self) -> str:
        return f"MeshOutput({self.store.describe('')})"

    def mesh(self, body: int) -> Mesh:
        """The body's mesh in nm (its finest level); NotFoundError when the output has none."""
        if self.legacy:
            names = json.loads(self._get(f"{body}:0", body)).get("fragments", [])
            return merge_fragments(decode_legacy_fragment(self._get(n.rsplit("/", 1)[-1], body)) for n in names)
        if self.sharding is None:
            manifest, data = self._get(f"{body}.index", body), self._get(f"{body}", body)
        else:
            manifest, data = self._sharded(body)
        m = decode_manifest(manifest)
        frags = decode_object(m, data, 0, int(self.info.get("vertex_quantization_bits", 16)))
        t = np.asarray(self.info.get("transform", [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0]), np.float64).reshape(3, 4)
        v = merge_fragments(frags)
        return Mesh((v.vertices.astype(np.float64) @ t[:, :3].T + t[:, 3]).astype(np.float32), v.faces)

    def _get(self, key: str, body: int) -> bytes:
        data = self.store.get_sync(key)
        if data is None:
            raise NotFoundError(f"no mesh of body {body} in {self.store.describe('')}")
        return bytes(data)

    def _sharded(self, body: int) -> tuple[bytes, bytes]:
        """(manifest, fragment data) of a body in neuroglancer's uint64 sharded format: the
        manifest is the indexed entry, its fragment data the bytes just before it."""
        sp = self.sharding
        assert sp is not None
        shard, mini = shard_of_key(sp, body)
        name = shard_key(shard, sp.shard_bits)
        base = 16 << sp.minishard_bits
        try:
            a, b = np.frombuffer(bytes(self.store.read_sync(name, 16 * mini, 16 * mini + 16)), "<u8").tolist()
        except (FileNotFoundError, NotFoundError):
            raise NotFoundError(f"no mesh of body {body} in {self.store.describe('')}") from None
        index = bytes(self.store.read_sync(name, base + a, base + b)) if b > a else b""
        if index and sp.minishard_index_encoding == "gzip":
            index = gzip.decompress(index)
        rows = np.frombuffer(index, "<u8").reshape(3, -1).astype(np.int64)
        keys, sizes = np.cumsum(rows[0]).astype(np.uint64), rows[2]
        starts = np.cumsum(rows[1] + np.concatenate([[0], sizes[:-1]]))
        hit = np.flatnonzero(keys == np.uint64(body))
        if not len(hit):
            raise NotFoundError(f"no mesh of body {body} in {self.store.describe('')}")
        start, size = int(starts[hit[0]]), int(sizes[hit[0]])
        manifest = bytes(self.store.read_sync(name, base + start, base + start + size))
        n = decode_manifest(manifest).data_size
        return manifest, bytes(self.store.read_sync(name, base + start - n, base + start))


def _json(store, key: str, location) -> object:
    try:
        data = store.get_sync(key)
        return json.loads(data) if data is not None else None
    except (OSError, ValueError) as e:
        raise SpecError(f"{location}: not a meshes output (cannot read its {key}: {e})") from None


class MeshSource:
    """A served volume's meshes (see the module): read from the ``meshes`` output, else made on
    demand within ``budget`` seconds (the label ``index`` finds a body's chunks);
    ``on_made(scale, nbytes, seconds)`` is called after each."""

    def __init__(self, ds, labels="agglomerated", *, meshes=None, budget: float = 2.0, index=None,
                 cache_bytes: int = 256 << 20, on_made: Callable[[int, int, float], None] | None = None):
        self.ds, self.labels = ds, as_labels(labels)
        self.output = MeshOutput(meshes) if meshes is not None else None
        self.budget = float(budget)
        self.index = None if index is None else index if isinstance(index, BodyIndex) else BodyIndex(index)
        self.on_made = on_made
        self.cell_seconds = 0.01  # learned: seconds to mesh one cell (decode + marching cubes)
        self._held: list[int] | None = None
        self._cache: Cache[bytes] = Cache(self._make, len, cache_bytes)

    def __repr__(self) -> str:
        return f"MeshSource({self.output or 'on demand'})"

    def get(self, body: int) -> bytes:
        """The body's legacy mesh (float32 nm); NotFoundError when it has none."""
        return self._cache.get(int(body))

    def cached(self, body: int) -> bool:
        return int(body) in self._cache

    def _make(self, body: int) -> bytes:
        if self.output is not None:
            return encode_legacy_fragment(self.output.mesh(body))
        t0 = time.perf_counter()
        if self._held is None:
            self._held = held_scales(self.ds)
        b = Body(self.ds, body, scale=self._held[0], labels=self.labels, index=self.index)
        k, chunks = self.choose_scale(b)
        if k is None:
            raise b.not_found()
        t1 = time.perf_counter()
        mesh = b.mesh(k, units="voxels", chunks=chunks)
        dt = time.perf_counter() - t1
        self.cell_seconds = 0.5 * self.cell_seconds + 0.5 * dt / max(_cells(chunks), 1)
        s = self.ds.scale(k)
        res = s.resolution if s.resolution is not None else [float(2 ** k)] * 3  # as view serves it
        data = encode_legacy_fragment(to_nm(mesh, res))
        if self.on_made is not None:
            self.on_made(k, len(data), time.perf_counter() - t0)
        log.info("mesh of body %d: scale %d, %d chunks, %d triangles, %.2f s", body, k, len(chunks),
                 len(mesh.faces), time.perf_counter() - t0)
        return data

    def choose_scale(self, body: Body) -> tuple[int | None, np.ndarray]:
        """(held scale to mesh, the body's chunks there); None: no voxel at any held scale.

        From the coarsest held scale down, the chunks holding the body are found and the cost
        estimated from the cells to mesh; the finest scale whose estimate fits the budget wins.
        """
        t0 = time.perf_counter()
        held = self._held or held_scales(self.ds)
        chosen: tuple[int | None, np.ndarray] = (None, np.zeros((0, 3), np.int64))
        for k in reversed(held):
            c = self._chunks(body, k)
            if not len(c):
                continue
            spent = time.perf_counter() - t0
            if chosen[0] is not None and spent + _cells(c) * self.cell_seconds > self.budget:
                break
            chosen = (k, c)
            if spent > self.budget / 2:
                break
        return chosen

    def _chunks(self, body: Body, k: int) -> np.ndarray:
        idx = body.index
        if idx is not None and idx.scale < k and idx.scale == (self._held or [idx.scale])[0]:
            # the index's blocks, coarsened: a superset of the chunks (no scan)
            c = body.chunks(idx.scale, missing_ok=True) >> (k - idx.scale)
            return np.unique(c, axis=0) if len(c) else c
        return body.chunks(k, missing_ok=True)


def _cells(chunks: np.ndarray) -> int:
    """Cells meshed for a body in these chunks: each chunk and its - neighbours."""
    d = np.array([[i, j, k] for k in (0, 1) for j in (0, 1) for i in (0, 1)], np.int64)
    return len(np.unique((np.asarray(chunks, np.int64)[:, None, :] - d[None]).reshape(-1, 3), axis=0))


class SkeletonSource:
    """A served volume's skeletons (see the module): read from the ``skeletons`` output (or a
    folder of SWC files), else made on demand at ``scale`` (default ``Body.skeleton``'s, made when
    the export lacks it)."""

    def __init__(self, ds, labels="agglomerated", *, skeletons=None, index=None, scale: int | None = None,
                 cache_bytes: int = 64 << 20):
        from ..jobs.skeletons import SkeletonOutput

        self.ds, self.labels = ds, as_labels(labels)
        self.voxel_size = ds.scales[0].resolution
        self.output = None if skeletons is None else SkeletonOutput(skeletons, voxel_size=self.voxel_size)
        self.index = None if index is None else index if isinstance(index, BodyIndex) else BodyIndex(index)
        self._scale = scale
        self._cache: Cache[Skeleton] = Cache(
            self._make, lambda sk: sk.vertices.nbytes + sk.edges.nbytes + sk.radii.nbytes, cache_bytes)

    def __repr__(self) -> str:
        return f"SkeletonSource({self.output or 'on demand'})"

    def get(self, body: int) -> Skeleton:
        """The body's skeleton; NotFoundError when it has none."""
        return self._cache.get(int(body))

    def cached(self, body: int) -> bool:
        return int(body) in self._cache

    def swc(self, body: int) -> bytes:
        """FlyEM's ``<body>_swc``: scale-0 voxels, radii in nm, DVID's mutation id comment first."""
        return ('# {"mutation id": 0}\n' + self.get(body).swc()).encode()

    def _make(self, body: int) -> Skeleton:
        if self.output is not None:
            sk = self.output.get(body)
            if sk is None:
                raise NotFoundError(f"no skeleton of body {body} in {self.output.where}")
            return sk
        t0 = time.perf_counter()
        b = Body(self.ds, body, labels=self.labels, index=self.index)
        sk = b.skeleton(scale=self._scale)
        log.info("skeleton of body %d: %d vertices, %.2f s", body, len(sk.vertices), time.perf_counter() - t0)
        return sk
