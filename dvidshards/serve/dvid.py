"""DVID's read-only ``labelmap`` HTTP API over an export: ``dvidshards serve-dvid`` and `serve`.

FlyEM's tools read segmentation through DVID (neuclease's ``fetch_*``, flyemflows, small
clients such as ``dvid-point-cloud``). This server answers the read endpoints of a labelmap
instance, with the request parameters and response bytes of DVID's help text
(``datatype/labelmap/labelmap.go``), from the export alone::

    GET /api/node/<uuid>/<instance>/info                      Base, Extended (BlockSize, VoxelSize,
                                                                MinPoint, MaxPoint, MaxDownresLevel)
    GET .../label/<x_y_z>        .../labels (JSON body)        ids at points
    GET .../sparsevol/<label>    format=rles|srles|blocks, minx..maxz, compression=gzip (rles)
    HEAD .../sparsevol/<label>   200 if it has voxels within the bounds, else 204
    GET .../sparsevol-by-point/<x_y_z>   .../sparsevol-coarse/<label>   .../sparsevol-size/<label>
    GET .../size/<label>   .../sizes (JSON body)   .../supervoxels/<label>   .../supervoxel-sizes/<label>
    GET .../mapping (JSON body)   .../mappings[?format=binary]
    GET .../index/<label>[?metadata-only=true]               DVID's LabelIndex protobuf
    GET .../specificblocks?blocks=x,y,z,...   .../blocks/<size>/<offset>
                                 compression=blocks|gzip|uncompressed|lz4
    GET .../raw/0_1_2/<size>/<offset>   .../maxlabel   .../help
    GET /api/repo/<uuid>/info    /api/server/info

Every read takes ``scale`` (a scale the export holds) and ``supervoxels=true``. Anything that
writes answers 405 with one line saying the server is read-only; an absent body 404 (where
DVID gives 404); a bad parameter 400 naming it. Body endpoints use the label index of
``dvidshards label-index`` when given (``--label-index``), else the records' label lists
(a scan of a scale's lists, no decompression); the ``X-Dvidshards-Index`` header of their
answers says which (``label-index`` or ``scan``).

Differences from DVID, all where DVID's own bytes are not reproducible or not defined by an
export: runs DVID writes in Go map order are sorted by (z, y); blocks of ``/blocks`` and
``/specificblocks`` come in (z, y, x) order (DVID: as its goroutines finish); ``lz4`` blocks
are valid lz4 holding one literal run (no matches: no lz4 library is needed); ``maxlabel``
is the largest id of the records' lists; ``sparsevol-coarse`` and ``sparsevol-size`` take
``scale`` (DVID: scale 0 only, the default here too).

The server is stateless: each process opens the export itself, answers from its files, and
keeps only caches of what the files say (shards, the info, the largest id), so any number of
processes can serve one export (``--reuse-port`` binds several to one port). Requests are
handled on an event loop (aiohttp); decoding runs in a bounded thread pool, at most
``2 x threads`` requests at a time, and large answers are streamed piece by piece (one chunk,
one shard's pairs, or the rles spans spooled to disk above 16 MiB), so memory stays bounded
whatever the bodies and the number of clients.

aiohttp is optional (``pip install dvidshards[serve]``); it is imported when a server starts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import os
import re
import socket
import tempfile
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..bodies import FORMATS, Body
from ..dataset import Dataset
from ..errors import DvidShardsError, MissingShardError, NotFoundError, SpecError
from ..formats.labelindex import encode_label_index
from ..formats.labels import Agglomerated, Supervoxels
from ..formats.records import list_values
from ..formats.sparsevol import HEADER
from ..query import BodyIndex, held_scales, label_at
from ..query import mapping as export_mapping

__all__ = ["DvidCommand", "DvidApi", "DvidServer", "Reply", "add_arguments", "main", "serve"]

log = logging.getLogger("dvidshards.serve.dvid")

_U64 = (1 << 64) - 1
_SPOOL = 16 << 20  # rles spans held in memory before the spool goes to disk
_PIECE = 1 << 20  # bytes per streamed piece of a spooled answer
MAX_RAW_VOXELS = 1 << 24  # /raw: 128 MiB of uint64 at most per request
MAX_BODY = 16 << 20  # request bodies (/labels, /sizes, /mapping)
INDEX_HEADER = "X-Dvidshards-Index"
_MUTATIONS = {"merge", "cleave", "split", "split-supervoxel", "renumber", "ingest-supervoxels", "set-nextlabel",
              "nextlabel", "extents", "resolution", "sync", "indices", "proximity"}
_UNSERVED = {"isotropic", "pseudocolor", "listlabels", "existing-labels", "lastmod", "index-version",
             "indices-compressed", "mutations", "mutations-range", "history", "supervoxel-splits",
             "sparsevols-coarse", "fvdb", "map-stats", "tags", "metadata"}
_READ_ONLY = "this server is read-only: it serves a dvidshards export and accepts no writes"


class BadRequest(DvidShardsError, ValueError):
    """A request parameter that cannot be used (answered 400, naming the parameter)."""


@dataclass
class Reply:
    """One answer: status, content type, headers, and the body as bytes or as a stream of pieces."""

    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict = field(default_factory=dict)
    stream: Iterator[bytes] | None = None


def _json(obj, status: int = 200, **headers) -> Reply:
    return Reply(status, json.dumps(obj, separators=(",", ":")).encode(), "application/json", dict(headers))


def _text(text: str, status: int) -> Reply:
    return Reply(status, (text.rstrip("\n") + "\n").encode(), "text/plain")


def _id_list(ids) -> bytes:
    return ("[" + ",".join(str(int(v)) for v in ids) + "]").encode()


def lz4_stored(data: bytes) -> bytes:
    """An lz4 *block* (no frame) holding ``data`` as one run of literals: valid lz4, no matches."""
    n = len(data)
    if n < 15:
        return bytes([n << 4]) + data
    rest = n - 15
    return bytes([0xF0]) + b"\xff" * (rest // 255) + bytes([rest % 255]) + data


def _gzip(data: bytes, level: int) -> bytes:
    c = zlib.compressobj(level, zlib.DEFLATED, 31)
    return c.compress(data) + c.flush()


# --------------------------------------------------------------------------- the API


class DvidApi:
    """The endpoints, one method each, independent of the HTTP server (a request in, a `Reply` out).

    Parameters
    ----------
    ds : Dataset
    index : BodyIndex, optional
        A label index (``dvidshards label-index``) of ``ds``.
    uuid, instance : str
        The node and the labelmap instance this export is served as.
    fill_missing_shards : bool
        Read missing shard files as background (DVID: absent blocks) instead of answering 500.
    """

    def __init__(self, ds: Dataset, index: BodyIndex | None = None, *, uuid: str, instance: str = "segmentation",
                 fill_missing_shards: bool = False):
        if not re.fullmatch(r"[0-9a-fA-F]{4,32}", uuid):
            raise SpecError(f"uuid {uuid!r}: give 4 to 32 hexadecimal digits, as DVID's")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", instance):
            raise SpecError(f"instance {instance!r}: give a name of letters, digits, '_', '.' or '-'")
        self.ds = ds
        self.index = index
        self.uuid = uuid.lower()
        self.instance = instance
        self.fill = bool(fill_missing_shards)
        self.held = held_scales(ds)
        if not self.held:
            raise SpecError(f"{ds.store.describe('')}: the export holds no scale with shard files")
        self._maxlabel: int | None = None
        self._lock = threading.Lock()

    # --- parameters -----------------------------------------------------------------------

    def _scale(self, q) -> int:
        text = q.get("scale", "0")
        try:
            k = int(text)
        except ValueError:
            raise BadRequest(f"scale={text!r}: give a scale number") from None
        if k not in self.held:
            raise BadRequest(f"scale={k}: this export holds scales {self.held}")
        return k

    @staticmethod
    def _flag(q, name: str) -> bool:
        text = q.get(name, "false").lower()
        if text not in ("true", "false", "1", "0", ""):
            raise BadRequest(f"{name}={text!r}: give true or false")
        return text in ("true", "1")

    def _labels(self, q):
        return Supervoxels() if self._flag(q, "supervoxels") else Agglomerated()

    @staticmethod
    def _label(text: str, what: str = "label") -> int:
        if not re.fullmatch(r"[0-9]{1,20}", text or "") or int(text) > _U64:
            raise BadRequest(f"{what} {text!r}: give a uint64 id")
        if int(text) == 0:
            raise BadRequest(f"{what} 0: label 0 is protected background and cannot be queried as a body")
        return int(text)

    @staticmethod
    def _point(text: str) -> list[int]:
        parts = (text or "").split("_")
        if len(parts) != 3 or not all(re.fullmatch(r"-?[0-9]{1,10}", p) for p in parts):
            raise BadRequest(f"coord {text!r}: give x_y_z voxel coordinates, e.g. 10_20_30")
        return [int(p) for p in parts]

    @staticmethod
    def _bounds(q):
        lo: list[int | None] = [None] * 3
        hi: list[int | None] = [None] * 3
        given = False
        for a, axis in enumerate("xyz"):
            for side, name in ((lo, f"min{axis}"), (hi, f"max{axis}")):
                if name in q:
                    try:
                        side[a] = int(q[name])
                    except ValueError:
                        raise BadRequest(f"{name}={q[name]!r}: give a voxel coordinate") from None
                    given = True
        return (lo, hi) if given else None

    @staticmethod
    def _json_body(body: bytes, what: str):
        try:
            return json.loads(body.decode() if body else "null")
        except (UnicodeDecodeError, ValueError) as e:
            raise BadRequest(f"request body: not JSON ({e}); give {what}") from None

    def _ids_body(self, body: bytes) -> list[int]:
        ids = self._json_body(body, "a JSON list of uint64 ids")
        if not isinstance(ids, list) or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _U64
                                                for v in ids):
            raise BadRequest("request body: give a JSON list of uint64 ids, e.g. [1, 2, 3]")
        return ids

    def _body(self, label: int, k: int, labels) -> tuple[Body, dict]:
        """The Body of a label, with the label index when it applies, and the header saying so."""
        idx = self.index
        use = idx is not None and isinstance(labels, Agglomerated) and idx.meta.get("labels") == "agglomerated" \
            and idx.scale <= k
        body = Body(self.ds, label, k, labels, index=idx if use else None)
        return body, {INDEX_HEADER: "label-index" if use else "scan"}

    # --- dispatch ---------------------------------------------------------------------------

    def answer(self, method: str, path: str, query, body: bytes = b"") -> Reply:
        """The reply to one request (errors included: 400, 404, 405, 500 with one line)."""
        try:
            return self._dispatch(method.upper(), path, query, body)
        except BadRequest as e:
            return _text(str(e), 400)
        except NotFoundError as e:
            return _text(str(e), 404)
        except SpecError as e:  # a request the library refuses (a point outside the volume, ...)
            return _text(str(e), 400)
        except MissingShardError as e:  # DVID answers absent blocks as background: say how to do so
            log.warning("%s %s: %s: %s", method, path, type(e).__name__, e)
            return _text(f"{type(e).__name__}: {' '.join(str(e).split())} (serve with --fill-missing-shards to "
                         f"answer missing shard files as background, as DVID answers absent blocks)", 500)
        except DvidShardsError as e:  # the export cannot answer (a damaged shard)
            log.warning("%s %s: %s: %s", method, path, type(e).__name__, e)
            return _text(f"{type(e).__name__}: {' '.join(str(e).split())}", 500)
        except Exception as e:  # a bug: logged in full, answered in one line
            log.exception("%s %s", method, path)
            return _text(f"internal error: {type(e).__name__}: {' '.join(str(e).split())}", 500)

    def _dispatch(self, method: str, path: str, q, body: bytes) -> Reply:
        parts = [p for p in path.split("/") if p]
        if parts[:1] != ["api"] or len(parts) < 3:
            return _text(f"{path}: not a DVID API path (/api/node/<uuid>/<instance>/...)", 404)
        if method not in ("GET", "HEAD"):
            return _text(_READ_ONLY, 405)
        if parts[1] == "server" and parts[2] == "info":
            return _json({"Server uptime": "", "Storage backend": "dvidshards export (read-only)",
                          "Server type": "dvidshards serve-dvid", "Cores": os.cpu_count()})
        if parts[1] == "repo" and len(parts) == 4 and parts[3] == "info":
            self._node(parts[2])
            return _json(self.repo_info())
        if parts[1] != "node" or len(parts) < 5:
            return _text(f"{path}: unknown API call; this server answers /api/node/{self.uuid}/{self.instance}/...", 404)
        self._node(parts[2])
        if parts[3] != self.instance:
            return _text(f"no data instance {parts[3]!r} in node {self.uuid}: it serves {self.instance!r}", 404)
        ep, args = parts[4], parts[5:]
        if ep in _MUTATIONS:
            return _text(_READ_ONLY, 405)
        handler = getattr(self, "ep_" + ep.replace("-", "_"), None)
        if handler is None:
            if ep in _UNSERVED:
                return _text(f"/{ep} is not served from an export (dvidshards serve-dvid)", 501)
            return _text(f"unrecognized API call {ep!r} for labelmap data {self.instance!r}", 400)
        if method == "HEAD" and ep != "sparsevol":
            reply = handler(args, q, body)
            reply.body, reply.stream = b"", None
            return reply
        return handler(args, q, body) if ep != "sparsevol" else self.ep_sparsevol(args, q, body, head=method == "HEAD")

    def _node(self, uuid: str) -> None:
        u = uuid.split(":")[0].lower()
        if not (uuid == ":master" or (u and self.uuid.startswith(u))):
            raise BadRequest(f"uuid {uuid!r}: this server holds one node, {self.uuid}")

    @staticmethod
    def _need(args, n: int, what: str) -> None:
        if len(args) < n:
            raise BadRequest(f"give {what} after the endpoint")

    # --- instance -----------------------------------------------------------------------------

    def base(self) -> dict:
        return {"TypeName": "labelmap", "TypeURL": "github.com/janelia-flyem/dvid/datatype/labelmap",
                "TypeVersion": "0.2", "DataUUID": self.uuid, "Name": self.instance, "RepoUUID": self.uuid,
                "Compression": "zstd (export-shards)", "Checksum": "", "Syncs": [], "Versioned": False,
                "KVStore": f"dvidshards export {self.ds.store.describe('')}", "LogStore": "", "Tags": {}}

    def info(self) -> dict:
        s = self.ds.scale(self.ds.scales[0].index)
        lo = [int(v) for v in s.voxel_offset]
        hi = [int(a + n - 1) for a, n in zip(s.voxel_offset, s.size, strict=True)]
        cs = [int(v) for v in s.chunk_size]
        res = [float(r) for r in s.resolution] if s.resolution is not None else [1.0, 1.0, 1.0]
        units = ["nanometers"] * 3 if s.resolution is not None else ["voxels"] * 3
        ext = {"Values": [{"DataType": "uint64", "Label": self.instance}], "Interpolable": False,
               "BlockSize": cs, "VoxelSize": res, "VoxelUnits": units, "MinPoint": lo, "MaxPoint": hi,
               "MinIndex": [a // c for a, c in zip(lo, cs, strict=True)],
               "MaxIndex": [b // c for b, c in zip(hi, cs, strict=True)], "Background": 0, "GridStore": "",
               "ScaleLevel": 0, "MaxLabel": {}, "MaxRepoLabel": 0, "NextLabel": 0, "IndexedLabels": True,
               "MaxDownresLevel": max(self.held)}
        return {"Base": self.base(), "Extended": ext, "Extents": {"MinPoint": lo, "MaxPoint": hi},
                "dvidshards": {"export": self.ds.store.describe(""), "scales": self.held,
                               "label_index": self.index.path if self.index is not None else None,
                               "label_index_scale": self.index.scale if self.index is not None else None}}

    def repo_info(self) -> dict:
        t = "0001-01-01T00:00:00Z"
        node = {"Branch": "", "Note": "", "Log": [], "UUID": self.uuid, "VersionID": 1, "Locked": True,
                "Parents": [], "Children": [], "Created": t, "Updated": t}
        return {"Root": self.uuid, "Alias": os.path.basename(self.ds.store.describe("").rstrip("/")),
                "Description": f"dvidshards export {self.ds.store.describe('')} (read-only)", "Log": [],
                "Properties": {}, "DataInstances": {self.instance: {"Base": self.base()}},
                "DAG": {"Root": self.uuid, "Nodes": {self.uuid: node}}, "MutationID": 0, "SavedMutationID": 0,
                "Created": t, "Updated": t}

    def ep_info(self, args, q, body) -> Reply:
        return _json(self.info())

    def ep_help(self, args, q, body) -> Reply:
        return Reply(200, (__doc__ or "").encode(), "text/plain")

    def ep_maxlabel(self, args, q, body) -> Reply:
        with self._lock:
            if self._maxlabel is None:
                k = self.held[0]
                top = 0
                for o in self.ds.shards(k):
                    t = self.ds.shard(k, o).table()
                    for which in ("labels", "supervoxels"):
                        v, _ = list_values(t, which)
                        if len(v):
                            top = max(top, int(v.max()))
                self._maxlabel = top
        return Reply(200, f'{{"maxlabel": {self._maxlabel}}}'.encode(), "application/json")

    # --- points -------------------------------------------------------------------------------

    def _labels_at(self, points, k: int, labels) -> np.ndarray:
        """label_at with DVID's answer for points outside the volume: 0."""
        p = np.asarray(points, np.int64).reshape(-1, 3)
        s = self.ds.scale(k)
        lo = np.asarray(s.voxel_offset, np.int64)
        inside = ((p >= lo) & (p < lo + np.asarray(s.size, np.int64))).all(axis=1)
        out = np.zeros(len(p), np.uint64)
        if inside.any():
            out[inside] = label_at(self.ds, p[inside], scale=k, labels=labels, fill_missing_shards=self.fill)
        return out

    def ep_label(self, args, q, body) -> Reply:
        self._need(args, 1, "a coordinate x_y_z")
        p = self._point(args[0])
        v = self._labels_at([p], self._scale(q), self._labels(q))
        return Reply(200, f'{{"Label": {int(v[0])}}}'.encode(), "application/json")

    def ep_labels(self, args, q, body) -> Reply:
        pts = self._json_body(body, "a JSON list of [x, y, z] points")
        if not isinstance(pts, list) or not all(
                isinstance(p, list) and len(p) == 3 and all(isinstance(v, int) and not isinstance(v, bool) for v in p)
                for p in pts):
            raise BadRequest("request body: give a JSON list of [x, y, z] integer points")
        k, labels = self._scale(q), self._labels(q)
        v = self._labels_at(pts, k, labels) if pts else np.zeros(0, np.uint64)
        return Reply(200, _id_list(v), "application/json")

    # --- bodies -------------------------------------------------------------------------------

    def ep_size(self, args, q, body) -> Reply:
        self._need(args, 1, "a label")
        b, head = self._body(self._label(args[0]), self._scale(q), self._labels(q))
        return Reply(200, f'{{"voxels": {b.size}}}'.encode(), "application/json", head)

    def ep_sizes(self, args, q, body) -> Reply:
        ids = self._ids_body(body)
        k, labels = self._scale(q), self._labels(q)
        out, head = [], {INDEX_HEADER: "scan"}
        for i in ids:
            if i == 0:
                out.append(0)
                continue
            b, head = self._body(i, k, labels)
            try:
                out.append(b.size)
            except NotFoundError:
                out.append(0)
        return Reply(200, _id_list(out), "application/json", head)

    def ep_supervoxels(self, args, q, body) -> Reply:
        self._need(args, 1, "a label")
        b, head = self._body(self._label(args[0]), self._scale(q), self._labels(q))
        return Reply(200, _id_list(b.supervoxels()), "application/json", head)

    def ep_supervoxel_sizes(self, args, q, body) -> Reply:
        self._need(args, 1, "a label")
        b, head = self._body(self._label(args[0]), self._scale(q), self._labels(q))
        sizes = b.supervoxel_sizes()
        text = (f'{{\n  "supervoxels": {_id_list(sizes).decode()},\n  "sizes": '
                f'{_id_list(sizes.values()).decode()}\n}}')
        return Reply(200, text.encode(), "application/json", head)

    def ep_sparsevol_size(self, args, q, body) -> Reply:
        self._need(args, 1, "a label")
        b, head = self._body(self._label(args[0]), self._scale(q), self._labels(q))
        c = b.chunks
        cs = np.asarray(self.ds.scale(b.scale).chunk_size, np.int64)
        lo, hi = c.min(axis=0) * cs, (c.max(axis=0) + 1) * cs - 1
        text = (f'{{"voxels": {b.size}, "numblocks": {len(c)}, "minvoxel": [{lo[0]}, {lo[1]}, {lo[2]}], '
                f'"maxvoxel": [{hi[0]}, {hi[1]}, {hi[2]}]}}')
        return Reply(200, text.encode(), "application/json", head)

    def ep_sparsevol(self, args, q, body, head: bool = False) -> Reply:
        self._need(args, 1, "a label")
        label = self._label(args[0])
        return self._sparsevol(label, q, head)

    def ep_sparsevol_by_point(self, args, q, body) -> Reply:
        self._need(args, 1, "a coordinate x_y_z")
        p = self._point(args[0])
        label = int(self._labels_at([p], self._scale(q), self._labels(q))[0])
        if not label:
            raise BadRequest(f"coord {args[0]}: the voxel is background (label 0)")
        return self._sparsevol(label, q, False)

    def _sparsevol(self, label: int, q, head: bool) -> Reply:
        k, labels = self._scale(q), self._labels(q)
        fmt = q.get("format", "rles")
        if fmt not in FORMATS:
            raise BadRequest(f"format={fmt!r}: give one of {', '.join(FORMATS)}")
        comp = q.get("compression", "")
        if comp not in ("", "gzip"):
            raise BadRequest(f"compression={comp!r}: sparsevol is served plain or with gzip (rles only)")
        if comp and fmt != "rles":
            raise BadRequest("compression: applies to format=rles only")
        self._flag(q, "exact")  # runs are always exact here (exact=false only allows less)
        bounds = self._bounds(q)
        b, hdr = self._body(label, k, labels)
        if head:
            c = b.chunks_at(k)
            if bounds is not None and len(c):
                cs = np.asarray(self.ds.scale(k).chunk_size, np.int64)
                blo = np.array([v if v is not None else -(1 << 31) for v in bounds[0]], np.int64) // cs
                bhi = np.array([v if v is not None else (1 << 31) - 1 for v in bounds[1]], np.int64) // cs
                c = c[((c >= blo) & (c <= bhi)).all(axis=1)]
            return Reply(200 if len(c) else 204, b"", "text/html", hdr)
        parts = b.sparsevol_parts(k, fmt, bounds)
        first = next(parts, b"")  # NotFoundError here, before anything is sent: a 404
        if fmt != "rles":
            return Reply(200, b"", "application/octet-stream", hdr, _chain(first, parts))
        return Reply(200, b"", "application/octet-stream", hdr, _rles(first, parts, comp == "gzip"))

    def ep_sparsevol_coarse(self, args, q, body) -> Reply:
        self._need(args, 1, "a label")
        b, head = self._body(self._label(args[0]), self._scale(q), self._labels(q))
        return Reply(200, b.sparsevol_coarse(bounds=self._bounds(q)), "application/octet-stream", head)

    def ep_index(self, args, q, body) -> Reply:
        self._need(args, 1, "a label")
        label = self._label(args[0])
        if "mutid" in q:
            raise BadRequest("mutid: an export holds one version; give no mutid")
        b, head = self._body(label, self._scale(q), self._labels(q))
        c, sv, n = b.supervoxel_counts()
        if self._flag(q, "metadata-only"):
            text = (f'{{"num_voxels":{int(n.sum())},"last_mutid":0,"last_mod_time":"","last_mod_user":"",'
                    f'"last_mod_app":""}}')
            return Reply(200, text.encode(), "application/json", head)
        return Reply(200, encode_label_index(label, c, sv, n), "application/octet-stream", head)

    # --- mappings -----------------------------------------------------------------------------

    def ep_mapping(self, args, q, body) -> Reply:
        svs = self._ids_body(body)
        self._flag(q, "nolookup")
        if not svs:
            return Reply(200, b"[]", "application/json", {INDEX_HEADER: "scan"})
        m = export_mapping(self.ds, scale=self.held[0], supervoxels=np.asarray(svs, np.uint64))
        keys, vals = np.asarray(m.keys), np.asarray(m.values)
        a = np.asarray(svs, np.uint64)
        pos = np.minimum(np.searchsorted(keys, a), max(len(keys) - 1, 0))
        found = (pos < len(keys)) & (keys[pos] == a) if len(keys) else np.zeros(len(a), bool)
        out = np.where(found, vals[pos] if len(keys) else 0, 0)  # DVID: 0 for a supervoxel that does not exist
        return Reply(200, _id_list(out), "application/json", {INDEX_HEADER: "scan"})

    def ep_mappings(self, args, q, body) -> Reply:
        fmt = q.get("format", "")
        if fmt not in ("", "binary", "text", "csv"):
            raise BadRequest(f"format={fmt!r}: give binary, or nothing for text")
        binary = fmt == "binary"
        if self.index is not None:
            pieces = self.index.pairs()
            head = {INDEX_HEADER: "label-index"}
        else:
            m = export_mapping(self.ds, scale=self.held[0])
            keys, vals = np.asarray(m.keys), np.asarray(m.values)
            step = 1 << 16
            pieces = ((keys[i:i + step], vals[i:i + step]) for i in range(0, len(keys), step))
            head = {INDEX_HEADER: "scan"}

        def encode() -> Iterator[bytes]:
            for sv, b in pieces:
                keep = sv != b  # DVID lists the non-identity mappings
                sv, b = sv[keep], b[keep]
                if not len(sv):
                    continue
                if binary:
                    yield np.stack([sv, b], axis=1).astype("<u8").tobytes()
                else:
                    yield "".join(f"{s} {t}\n" for s, t in zip(sv.tolist(), b.tolist(), strict=True)).encode()

        return Reply(200, b"", "application/octet-stream" if binary else "text/plain", head, encode())

    # --- blocks -------------------------------------------------------------------------------

    def _compression(self, q, default: str) -> str:
        comp = q.get("compression", "") or default
        if comp not in ("blocks", "gzip", "uncompressed", "lz4"):
            raise BadRequest(f"compression={comp!r}: give blocks, gzip, uncompressed or lz4")
        return comp

    def _block_records(self, k: int, labels, chunks: np.ndarray, comp: str) -> Iterator[bytes]:
        """``/blocks`` records of the chunks present, in the given order, one shard's at a time."""
        s = self.ds.scale(k)
        reader = self.ds.reader(s, labels, fill_missing_shards=self.fill)
        cs = np.asarray(s.chunk_size, np.int64)
        e = np.asarray([min(s.shard_extent, 1 << 40)] * 3, np.int64) // cs
        key = chunks // np.maximum(e, 1)
        # consecutive chunks of one shard form a run: one fetch each, order kept
        if not len(chunks):
            return
        start = np.flatnonzero(np.concatenate([[True], (key[1:] != key[:-1]).any(axis=1)])).tolist()
        for a, z in zip(start, start[1:] + [len(chunks)], strict=True):
            run = chunks[a:z]
            shard = reader.shard(*(int(v) for v in run[0]))
            if shard is None:
                continue
            found = [(i, c) for i, c in ((shard.find(*(int(v) for v in c)), c) for c in run) if i is not None]
            if not found:
                continue
            t = shard.table(np.asarray([i for i, _ in found], np.int64))
            out = []
            for r, (_, c) in enumerate(found):
                data = self._payload(t, r, labels, comp, tuple(int(v) for v in cs[::-1]))
                out.append(np.array([c[0], c[1], c[2], len(data)], "<i4").tobytes() + data)
            yield b"".join(out)

    @staticmethod
    def _payload(t, r: int, labels, comp: str, shape) -> bytes:
        if comp == "blocks":  # DVID's native block, its label list mapped unless supervoxels: re-wrapped in gzip
            block = t.block(r)
            pal = labels.palette(t, r)
            if pal is not None:
                n = int.from_bytes(block[12:16], "little")
                block = block[:16] + np.asarray(pal, "<u8").tobytes() + block[16 + 8 * n:]
            return _gzip(block, 6)
        vol = np.empty(shape, np.uint64)
        t.decode_into(r, vol, labels)
        raw = vol.astype("<u8", copy=False).tobytes()
        if comp == "gzip":
            return _gzip(raw, 1)
        return raw if comp == "uncompressed" else lz4_stored(raw)

    def ep_specificblocks(self, args, q, body) -> Reply:
        k, labels = self._scale(q), self._labels(q)
        comp = self._compression(q, "blocks")
        text = q.get("blocks", "")
        if not text:
            return Reply(200, b"", "application/octet-stream")
        try:
            v = [int(x) for x in text.split(",")]
        except ValueError:
            raise BadRequest(f"blocks={text[:60]!r}: give x,y,z block coordinates separated by commas") from None
        if len(v) % 3:
            raise BadRequest(f"blocks: {len(v)} numbers is not three per block")
        c = np.asarray(v, np.int64).reshape(-1, 3)
        return Reply(200, b"", "application/octet-stream", {}, self._block_records(k, labels, c, comp))

    def ep_blocks(self, args, q, body) -> Reply:
        self._need(args, 2, "<size>/<offset>, e.g. 128_128_128/0_0_64")
        k, labels = self._scale(q), self._labels(q)
        comp = self._compression(q, "lz4")
        size, off = self._point(args[0]), self._point(args[1])
        cs = np.asarray(self.ds.scale(k).chunk_size, np.int64)
        if any(v <= 0 for v in size):
            raise BadRequest(f"size {args[0]}: give positive sizes")
        if (np.asarray(size) % cs).any() or (np.asarray(off) % cs).any():
            raise BadRequest(f"size {args[0]} / offset {args[1]}: the subvolume must be block aligned ({cs.tolist()})")
        lo, n = np.asarray(off) // cs, np.asarray(size) // cs
        return Reply(200, b"", "application/octet-stream", {}, self._box_records(k, labels, lo, lo + n, comp))

    def _box_records(self, k: int, labels, lo: np.ndarray, hi: np.ndarray, comp: str) -> Iterator[bytes]:
        """Records of the chunks present in [lo, hi) (chunk coordinates), z, y, x order, a row at a time."""
        s = self.ds.scale(k)
        cs = np.asarray(s.chunk_size, np.int64)
        vlo = np.asarray(s.voxel_offset, np.int64) // cs
        vhi = -(-(np.asarray(s.voxel_offset, np.int64) + np.asarray(s.size, np.int64)) // cs)
        lo, hi = np.maximum(lo, vlo), np.minimum(hi, vhi)
        if (hi <= lo).any():
            return
        xs = np.arange(lo[0], hi[0], dtype=np.int64)
        for z in range(int(lo[2]), int(hi[2])):
            for y in range(int(lo[1]), int(hi[1])):
                row = np.stack([xs, np.full_like(xs, y), np.full_like(xs, z)], axis=1)
                yield from self._block_records(k, labels, row, comp)

    def ep_raw(self, args, q, body) -> Reply:
        self._need(args, 3, "0_1_2/<size>/<offset>")
        if args[0] != "0_1_2":
            raise BadRequest(f"dims {args[0]!r}: this server answers 3-d requests (0_1_2)")
        if len(args) > 3 and args[3] not in ("", "raw"):
            raise BadRequest(f"format {args[3]!r}: only raw uint64 is served")
        size, off = self._point(args[1]), self._point(args[2])
        if any(v <= 0 for v in size):
            raise BadRequest(f"size {args[1]}: give positive sizes")
        if int(np.prod(size)) > MAX_RAW_VOXELS:
            raise BadRequest(f"size {args[1]}: more than {MAX_RAW_VOXELS} voxels; ask for smaller pieces "
                             f"(or /blocks, streamed)")
        comp = q.get("compression", "")
        if comp not in ("", "gzip"):
            raise BadRequest(f"compression={comp!r}: raw is served plain or with gzip")
        k, labels = self._scale(q), self._labels(q)
        box = [off, [a + n for a, n in zip(off, size, strict=True)]]
        vol = self.ds.read(box, scale=k, labels=labels, fill_missing_shards=self.fill)
        raw = np.ascontiguousarray(vol.T).astype("<u8", copy=False).tobytes()  # z, y, x with x fastest
        return Reply(200, _gzip(raw, 1) if comp else raw, "application/octet-stream")


def _chain(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    yield first
    yield from rest


def _rles(first: bytes, rest: Iterator[bytes], gzip: bool) -> Iterator[bytes]:
    """Legacy rles: every span spooled (memory up to 16 MiB, then a temporary file), counted,
    then the header and the spans in pieces; DVID writes nothing at all when no span is left."""
    with tempfile.SpooledTemporaryFile(max_size=_SPOOL) as spool:
        n = 0
        for piece in _chain(first, rest):
            spool.write(piece)
            n += len(piece)
        if not n:
            return
        spool.seek(0)
        z = zlib.compressobj(6, zlib.DEFLATED, 31) if gzip else None
        head = HEADER.pack(0, 3, 0, 0, 0, n // 16)
        yield z.compress(head) if z is not None else head
        while True:
            piece = spool.read(_PIECE)
            if not piece:
                break
            yield z.compress(piece) if z is not None else piece
        if z is not None:
            yield z.flush()


# --------------------------------------------------------------------------- the HTTP server


class DvidServer:
    """A running server (on its own thread and event loop); `serve` makes one.

    Attributes
    ----------
    url : str
        ``http://host:port`` it listens on.
    api : DvidApi
    """

    def __init__(self, api: DvidApi, host: str = "127.0.0.1", port: int = 8000, *, threads: int | None = None,
                 reuse_port: bool = False):
        try:
            from aiohttp import web  # noqa: F401 - optional: checked before anything starts
        except ImportError:
            raise SpecError("serve-dvid needs aiohttp: pip install 'dvidshards[serve]'") from None
        self.api = api
        self.threads = int(threads or min(8, os.cpu_count() or 2))
        if self.threads < 1:
            raise SpecError("threads must be at least 1")
        self.pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="serve-dvid")
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            self._sock.bind((host, int(port)))
        except OSError as e:
            self._sock.close()
            raise SpecError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None
        self._sock.listen(256)
        self.host, self.port = host, int(self._sock.getsockname()[1])
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: Any = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> DvidServer:
        """Start answering (returns when the server listens)."""
        self._thread = threading.Thread(target=self._run, name="serve-dvid-loop", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._setup())
        except BaseException as e:  # noqa: BLE001 - handed to start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        loop.run_forever()
        try:  # closes the connections (1 s for answers in flight) and the listening socket
            loop.run_until_complete(self._runner.cleanup())
        except Exception:
            log.debug("serve-dvid: cleanup", exc_info=True)
        loop.close()

    async def _setup(self) -> None:
        from aiohttp import web

        sem = asyncio.Semaphore(2 * self.threads)
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_route("*", "/{tail:.*}", self._handler(sem))
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.SockSite(self._runner, self._sock).start()

    def _handler(self, sem: asyncio.Semaphore):
        from aiohttp import web

        api, pool = self.api, self.pool

        async def handle(request):
            loop = asyncio.get_running_loop()
            body = await request.read() if request.can_read_body else b""
            async with sem:  # bounded work in flight: memory does not grow with clients
                reply = await loop.run_in_executor(pool, api.answer, request.method, request.path,
                                                   dict(request.query), body)
                headers = {"Access-Control-Allow-Origin": "*", **reply.headers}
                if reply.stream is None:
                    return web.Response(status=reply.status, body=reply.body, content_type=reply.content_type,
                                        headers=headers)
                it = reply.stream
                try:
                    first = await loop.run_in_executor(pool, next, it, None)
                except Exception as e:  # failed before anything was sent: still a clean answer
                    await loop.run_in_executor(pool, it.close)  # type: ignore[attr-defined]
                    if not isinstance(e, DvidShardsError):
                        log.error("%s %s", request.method, request.path, exc_info=True)
                    status = 404 if isinstance(e, NotFoundError) else 400 if isinstance(e, SpecError) else 500
                    return web.Response(status=status, text=f"{type(e).__name__}: {' '.join(str(e).split())}\n",
                                        headers=headers)
                resp = web.StreamResponse(status=reply.status, headers=headers)
                resp.content_type = reply.content_type
                await resp.prepare(request)
                try:
                    piece = first
                    while piece is not None:
                        if piece:
                            await resp.write(piece)
                        piece = await loop.run_in_executor(pool, next, it, None)
                except (ConnectionError, asyncio.CancelledError):
                    raise  # the client went away
                except Exception:
                    log.warning("%s %s: the answer failed after its headers were sent", request.method,
                                request.path, exc_info=True)
                    raise  # the connection is dropped: the client sees a truncated answer, never a wrong one
                finally:
                    await loop.run_in_executor(pool, it.close)  # type: ignore[attr-defined]
                await resp.write_eof()
                return resp

        return handle

    def shutdown(self) -> None:
        """Stop answering and release the port and the threads."""
        loop = self._loop
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.pool.shutdown(wait=False, cancel_futures=True)
        if not self._ready.is_set() or self._error is not None:  # never served: the socket is still ours
            self._sock.close()

    def wait(self) -> None:
        """Block until the server stops (Ctrl-C stops it)."""
        assert self._thread is not None, "start() first"
        try:
            while self._thread.is_alive():
                self._thread.join(0.5)
        except KeyboardInterrupt:  # the way to stop a server: not an error
            pass
        finally:
            self.shutdown()

    def __enter__(self) -> DvidServer:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"DvidServer({self.url}/api/node/{self.api.uuid}/{self.api.instance})"


def default_uuid(ds: Dataset) -> str:
    """A node uuid of the export: the same in every process serving it (a hash of where it is)."""
    return hashlib.sha256(ds.store.describe("").encode()).hexdigest()[:32]


def serve(export, *, spec=None, label_index=None, host: str = "127.0.0.1", port: int = 8000, uuid: str | None = None,
          instance: str = "segmentation", threads: int | None = None, fill_missing_shards: bool = False,
          reuse_port: bool = False) -> DvidServer:
    """Serve an export as DVID's read-only labelmap API; returns the running `DvidServer`.

    Parameters
    ----------
    export : str, path, URL or Dataset
        The export (a folder, gs://, s3://, http(s)://), or an open Dataset.
    spec : dict or path, optional
        Its neuroglancer multiscale spec (see ``Dataset``).
    label_index : path, optional
        A label index of the export (``dvidshards label-index``): body endpoints read it
        instead of scanning the records' lists.
    host, port :
        Where to listen (port 0: any free port; ``server.url`` says which).
    uuid : str, optional
        The node uuid clients use (default: `default_uuid`, the same for every process).
    instance : str
        The labelmap instance name (default ``segmentation``).
    threads : int, optional
        Decoding threads (default: the cores, at most 8); ``2 x threads`` requests are worked
        on at a time, the others wait.
    fill_missing_shards : bool
        Answer a missing shard file as background (DVID's absent blocks) instead of 500.
    reuse_port : bool
        Let other processes listen on the same port (SO_REUSEPORT): the kernel spreads
        connections over them.

    Examples
    --------
    >>> server = serve("export/", spec="mcns-ng-specs.json", port=0)   # doctest: +SKIP
    >>> requests.get(f"{server.url}/api/node/{server.api.uuid}/segmentation/sparsevol-size/123").json()
    """
    ds = export if isinstance(export, Dataset) else Dataset(export, spec=spec)
    idx = BodyIndex(label_index) if label_index is not None else None
    api = DvidApi(ds, idx, uuid=uuid or default_uuid(ds), instance=instance, fill_missing_shards=fill_missing_shards)
    return DvidServer(api, host, port, threads=threads, reuse_port=reuse_port).start()


# --------------------------------------------------------------------------- command line


def add_arguments(p) -> None:
    """Arguments of ``dvidshards serve-dvid``."""
    p.add_argument("export", help="export root: a folder, gs://, s3://, http(s):// URL or kvstore JSON")
    p.add_argument("--spec", help="the neuroglancer multiscale spec given to DVID's export-shards")
    p.add_argument("--label-index", metavar="DIR", help="a label index (dvidshards label-index): body endpoints "
                                                        "read it instead of scanning the records' lists")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port, printed)")
    p.add_argument("--uuid", help="node uuid clients use (default: a hash of the export's location, the same in "
                                  "every process)")
    p.add_argument("--instance", default="segmentation", help="labelmap instance name (default segmentation)")
    p.add_argument("--threads", type=int, default=None, help="decoding threads (default: cores, at most 8)")
    p.add_argument("--fill-missing-shards", action="store_true",
                   help="answer a missing shard file as background (DVID's absent blocks) instead of 500")
    p.add_argument("--reuse-port", action="store_true",
                   help="let several serve-dvid processes listen on this port (SO_REUSEPORT)")


def main(args) -> int:
    """Run ``dvidshards serve-dvid``: print the node's URL, then serve until interrupted."""
    import sys

    if not 0 <= args.port <= 65535:
        raise SpecError(f"--port {args.port}: give 0..65535")
    server = serve(args.export, spec=args.spec, label_index=args.label_index, host=args.host, port=args.port,
                   uuid=args.uuid, instance=args.instance, threads=args.threads,
                   fill_missing_shards=args.fill_missing_shards, reuse_port=args.reuse_port)
    print(f"{server.url}/api/node/{server.api.uuid}/{server.api.instance}", flush=True)
    print(f"serving {server.api.ds.store.describe('')} as DVID node {server.api.uuid}, scales {server.api.held}"
          f"{', label index ' + server.api.index.path if server.api.index is not None else ''} (Ctrl-C to stop)",
          file=sys.stderr, flush=True)
    server.wait()
    return 0


class DvidCommand:
    """``dvidshards serve-dvid``: one row of ``cli.COMMANDS``."""

    add_arguments = staticmethod(add_arguments)
    main = staticmethod(main)
