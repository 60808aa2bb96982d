"""A labelmap instance of serve-dvid: DVID's read endpoints over one export.

The volume endpoints (``raw``, ``isotropic``, ``blocks``, ``specificblocks``, ``label(s)``) are in
:mod:`dvidshards.serve.dvid_volume`; this module holds the instance's description (``info``,
``tags``, ``metadata``, ``help``) and every body, mapping and index endpoint. A snapshot has no
history: ``mutations``, ``mutations-range``, ``history`` and ``supervoxel-splits`` are DVID's
empty answers, ``lastmod`` gives mutation id 0 and the export's time for every body that exists.
Body endpoints use the label index of ``dvidshards label-index`` when given, else the records'
label lists (``X-Dvidshards-Index`` says which).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator

import numpy as np

from ..bodies import FORMATS, Body
from ..errors import NotFoundError
from ..formats.labelindex import encode_label_index
from ..formats.labels import Agglomerated, Supervoxels
from ..formats.records import list_values
from ..formats.sparsevol import (
    BLOCKS_HEADER,
    HEADER,
    RunOrder,
    binary_block,
    clip_runs,
    runs_from_mask,
)
from ..query import BodyIndex, SupervoxelTable, lookup, supervoxel_table
from ..query import unique as export_unique
from .dvid_base import (
    BadRequest,
    Gone,
    Reply,
    Request,
    id_list,
    ids_body,
    json_reply,
    label_arg,
    labels_of,
    need,
    parse_bounds,
    parse_flag,
    parse_int,
    parse_point,
)
from .dvid_volume import Pyramid, VolumeEndpoints

__all__ = ["INDEX_HEADER", "LabelmapInstance"]

log = logging.getLogger("dvidshards.serve.dvid")

INDEX_HEADER = "X-Dvidshards-Index"
_SPOOL = 16 << 20  # rles spans held in memory before the spool goes to disk
_PIECE = 1 << 20
MAX_LISTLABELS = 10_000_000
_WRITES = {"merge", "cleave", "split", "split-supervoxel", "renumber", "ingest-supervoxels", "set-nextlabel",
           "extents", "resolution", "sync"}
_QUICK = {"help", "tags", "mutations", "mutations-range", "history", "supervoxel-splits"}


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


class LabelmapInstance:
    """One export (its held scales ``held``) served as DVID labelmap instance ``name`` of node ``uuid``;
    ``fill``: missing shard files inside the volume are background (False: ``--strict``); ``time``:
    the export's time, DVID's "last mod time" of every body."""

    type_name = "labelmap"

    def __init__(self, ds, name: str, uuid: str, held: list[int], *, index: BodyIndex | None = None,
                 fill: bool = True, time: str = "0001-01-01T00:00:00Z", describe: str = ""):
        self.ds, self.name, self.uuid, self.index, self.fill, self.time = ds, name, uuid, index, fill, time
        self.held = held
        self.describe = describe
        self.pyramid = Pyramid(ds, held, fill=fill)
        s0 = ds.scale(held[0])
        self.volume = VolumeEndpoints(self.pyramid, ds.scale(ds.scales[0].index).resolution
                                      if ds.scales[0].resolution is not None else s0.resolution)
        self._lock = threading.Lock()
        self._maxlabel: int | None = None
        self._bodies: tuple[np.ndarray, np.ndarray | None] | None = None
        self._table: SupervoxelTable | None = None
        self.routes = self._route_table()

    def _route_table(self) -> dict:
        r = {"help": self.ep_help, "info": self.ep_info, "tags": self.ep_tags, "metadata": self.ep_metadata,
             "map-stats": self.ep_map_stats, "maxlabel": self.ep_maxlabel, "nextlabel": self.ep_nextlabel,
             "size": self.ep_size, "sizes": self.ep_sizes, "supervoxels": self.ep_supervoxels,
             "supervoxel-sizes": self.ep_supervoxel_sizes, "sparsevol-size": self.ep_sparsevol_size,
             "sparsevol": self.ep_sparsevol, "sparsevol-by-point": self.ep_sparsevol_by_point,
             "sparsevol-coarse": self.ep_sparsevol_coarse, "sparsevols-coarse": self.ep_sparsevols_coarse,
             "index": self.ep_index, "indices": self.ep_indices, "indices-compressed": self.ep_indices_compressed,
             "index-version": self.ep_index_version, "lastmod": self.ep_lastmod, "listlabels": self.ep_listlabels,
             "existing-labels": self.ep_existing_labels, "mapping": self.ep_mapping, "mappings": self.ep_mappings,
             "mutations": self.ep_empty_log, "mutations-range": self.ep_empty_log, "history": self.ep_history,
             "supervoxel-splits": self.ep_supervoxel_splits, "proximity": self.ep_proximity,
             "pseudocolor": self.ep_pseudocolor, "fvdb": self.ep_fvdb}
        r.update(self.volume.routes())
        return r

    def quick(self, endpoint: str, r: Request) -> bool:
        """Whether the answer is in memory already (answered on the event loop, no thread hop)."""
        if endpoint in _QUICK:
            return True
        if endpoint in ("info", "metadata", "maxlabel", "nextlabel"):
            return self._maxlabel is not None
        if endpoint == "mapping":
            return self._table is not None and len(r.body) < 1 << 16  # a few thousand ids
        return endpoint == "label" and self.volume.quick_label(r)

    def is_write(self, endpoint: str, method: str) -> bool:
        return endpoint in _WRITES or method not in ("GET", "HEAD")

    # --- description ------------------------------------------------------------------------------

    def base(self) -> dict:
        return {"TypeName": "labelmap", "TypeURL": "github.com/janelia-flyem/dvid/datatype/labelmap",
                "TypeVersion": "0.1", "DataUUID": self.uuid, "Name": self.name, "RepoUUID": self.uuid,
                "Compression": "Zstandard", "Checksum": "No checksum", "Syncs": [], "Versioned": True,
                "KVStore": f"dvidshards export {self.describe}", "LogStore": "no mutation log set", "Tags": {}}

    def extended(self) -> dict:
        s = self.ds.scale(self.ds.scales[0].index)
        lo = [int(v) for v in s.voxel_offset]
        hi = [int(a + n - 1) for a, n in zip(s.voxel_offset, s.size, strict=True)]
        cs = [int(v) for v in s.chunk_size]
        res = [float(r) for r in s.resolution] if s.resolution is not None else [8.0, 8.0, 8.0]
        return {"Values": [{"DataType": "uint64", "Label": "labelmap"}], "Interpolable": False,
                "BlockSize": cs, "VoxelSize": res, "VoxelUnits": ["nanometers"] * 3, "MinPoint": lo, "MaxPoint": hi,
                "MinIndex": [a // c for a, c in zip(lo, cs, strict=True)],
                "MaxIndex": [b // c for b, c in zip(hi, cs, strict=True)], "Background": 0, "GridStore": "",
                "ScaleLevel": 0, "MaxLabel": {}, "MaxRepoLabel": self.maxlabel(), "NextLabel": 0,
                "IndexedLabels": True, "MaxDownresLevel": self.pyramid.max_level}

    def info(self) -> dict:
        ext = self.extended()
        return {"Base": self.base(), "Extended": ext,
                "Extents": {"MinPoint": ext["MinPoint"], "MaxPoint": ext["MaxPoint"]},
                "dvidshards": {"export": self.describe, "scales": self.held, "served_scales": self.pyramid.served,
                               "label_index": self.index.path if self.index is not None else None,
                               "label_index_scale": self.index.scale if self.index is not None else None,
                               "missing_shards": "background" if self.fill else "error (--strict)"}}

    def ep_info(self, r: Request) -> Reply:
        return json_reply(self.info())

    def ep_help(self, r: Request) -> Reply:
        return Reply(200, (__doc__ or "").encode(), "text/plain")

    def ep_tags(self, r: Request) -> Reply:
        return Reply(200, b'{"Tags":{}}')

    def ep_metadata(self, r: Request) -> Reply:
        ext = self.extended()
        axes = [{"Label": a, "Resolution": ext["VoxelSize"][i], "Units": "nanometers",
                 "Size": ext["MaxPoint"][i] - ext["MinPoint"][i] + 1, "Offset": ext["MinPoint"][i]}
                for i, a in enumerate("XYZ")]
        props = {k: ext[k] for k in ("Values", "Interpolable", "BlockSize", "VoxelSize", "VoxelUnits", "MinPoint",
                                     "MaxPoint", "MinIndex", "MaxIndex", "Background", "GridStore", "ScaleLevel")}
        return Reply(200, (json.dumps({"Axes": axes, "Properties": props}, separators=(",", ":")) + "\n").encode(),
                     "application/vnd.dvid-nd-data+json")

    def ep_map_stats(self, r: Request) -> Reply:
        # DVID's in-memory mapping of this instance: the export's sv -> body pairs, one version
        n = len(self.table().keys)
        return json_reply({self.name: {"MapEntries": n, "MapSize": f"{16 * n} B", "NumVersions": 1,
                                       "MaxVersion": 1}})

    def ep_maxlabel(self, r: Request) -> Reply:
        return Reply(200, f'{{"maxlabel": {self.maxlabel()}}}'.encode())

    def ep_nextlabel(self, r: Request) -> Reply:
        return Reply(200, f'{{"nextlabel": {self.maxlabel() + 1}}}'.encode())

    def maxlabel(self) -> int:
        """The largest id of the records' lists (supervoxels and bodies) of the finest held scale."""
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
            return self._maxlabel

    # --- parameters -------------------------------------------------------------------------------

    def _held_scale(self, q, what: str) -> int:
        k = self.pyramid.scale(q)
        if k not in self.held:
            raise BadRequest(f"scale={k}: {what} is answered at the scales the export holds ({self.held}); "
                             f"scale {k} is made on demand for voxels, sparse volumes and blocks")
        return k

    def _body(self, label: int, k: int, labels) -> tuple[Body, dict]:
        """The Body of a label, with the label index when it applies (an index of bodies serves
        supervoxels too), and the header saying so."""
        idx = self.index
        use = idx is not None and idx.scale <= k and idx.meta.get("labels") in ("agglomerated", labels.name)
        body = Body(self.ds, label, scale=k, labels=labels, index=idx if use else None)
        return body, {INDEX_HEADER: "label-index" if use else "scan"}

    def table(self) -> SupervoxelTable:
        """The export's supervoxel -> body table (from the label index when it is of bodies at the
        finest held scale), built once per process."""
        if self._table is None:
            self._table = supervoxel_table(self.ds, scale=self.held[0], index=self.index)
        return self._table

    def _table_header(self) -> dict:
        idx = self.index
        use = idx is not None and idx.scale == self.held[0] and idx.meta.get("labels") == "agglomerated"
        return {INDEX_HEADER: "label-index" if use else "scan"}

    def _exists(self, label: int) -> tuple[Body, dict]:
        b, head = self._body(label, self.held[0], Agglomerated())
        if not b.exists():
            raise Gone(f"body {label} does not exist in this export")
        return b, head

    # --- body facts -------------------------------------------------------------------------------

    def ep_size(self, r: Request) -> Reply:
        need(r.args, 1, "a label")
        k = self._held_scale(r.query, "/size")
        b, head = self._body(label_arg(r.args[0]), k, labels_of(r.query))
        return Reply(200, f'{{"voxels": {b.size()}}}'.encode(), "application/json", head)

    def ep_sizes(self, r: Request) -> Reply:
        ids = ids_body(r.body)
        k, labels = self._held_scale(r.query, "/sizes"), labels_of(r.query)
        out, head = [], {INDEX_HEADER: "scan"}
        for i in ids:
            if i == 0:
                out.append(0)
                continue
            b, head = self._body(i, k, labels)
            try:
                out.append(b.size())
            except NotFoundError:
                out.append(0)
        return Reply(200, id_list(out), "application/json", head)

    def ep_supervoxels(self, r: Request) -> Reply:
        need(r.args, 1, "a label")
        b, head = self._body(label_arg(r.args[0]), self._held_scale(r.query, "/supervoxels"), labels_of(r.query))
        return Reply(200, id_list(b.supervoxels()), "application/json", head)

    def ep_supervoxel_sizes(self, r: Request) -> Reply:
        need(r.args, 1, "a label")
        k = self._held_scale(r.query, "/supervoxel-sizes")
        b, head = self._body(label_arg(r.args[0]), k, labels_of(r.query))
        sizes = b.supervoxel_sizes()
        text = (f'{{\n  "supervoxels": {id_list(sizes).decode()},\n  "sizes": '
                f'{id_list(sizes.values()).decode()}\n}}')
        return Reply(200, text.encode(), "application/json", head)

    def ep_sparsevol_size(self, r: Request) -> Reply:
        need(r.args, 1, "a label")
        k = self._held_scale(r.query, "/sparsevol-size")
        b, head = self._body(label_arg(r.args[0]), k, labels_of(r.query))
        c = b.chunks()
        cs = np.asarray(self.ds.scale(b.scale).chunk_size, np.int64)
        lo, hi = c.min(axis=0) * cs, (c.max(axis=0) + 1) * cs - 1
        text = (f'{{"voxels": {b.size()}, "numblocks": {len(c)}, "minvoxel": [{lo[0]}, {lo[1]}, {lo[2]}], '
                f'"maxvoxel": [{hi[0]}, {hi[1]}, {hi[2]}]}}')
        return Reply(200, text.encode(), "application/json", head)

    def ep_lastmod(self, r: Request) -> Reply:
        need(r.args, 1, "a label")
        self._exists(label_arg(r.args[0]))
        text = f'{{"mutation id": 0, "last mod user": "", "last mod app": "", "last mod time": "{self.time}" }}'
        return Reply(200, text.encode())

    def ep_index_version(self, r: Request) -> Reply:
        need(r.args, 1, "a label")
        self._exists(label_arg(r.args[0]))
        return Reply(200, self.uuid.encode(), "text/plain")

    # --- sparse volumes ---------------------------------------------------------------------------

    def ep_sparsevol(self, r: Request) -> Reply:
        need(r.args, 1, "a label")
        return self._sparsevol(label_arg(r.args[0]), r.query, r.head)

    def ep_sparsevol_by_point(self, r: Request) -> Reply:
        need(r.args, 1, "a coordinate x_y_z")
        p = parse_point(r.args[0])
        label = int(self.pyramid.labels_at([p], self.pyramid.scale(r.query), labels_of(r.query))[0])
        if not label:
            raise BadRequest(f"coord {r.args[0]}: the voxel is background (label 0)")
        return self._sparsevol(label, r.query, False)

    def _sparsevol(self, label: int, q, head: bool) -> Reply:
        k, labels = self.pyramid.scale(q), labels_of(q)
        fmt = q.get("format", "rles")
        if fmt not in FORMATS:
            raise BadRequest(f"format={fmt!r}: give one of {', '.join(FORMATS)}")
        comp = q.get("compression", "")
        if comp not in ("", "gzip", "lz4"):
            raise BadRequest(f"compression={comp!r}: sparsevol is served plain, with gzip or lz4 (rles only)")
        if comp and fmt != "rles":
            raise BadRequest("compression: applies to format=rles only")
        parse_flag(q, "exact")  # runs are always exact here (exact=false only allows less)
        bounds = parse_bounds(q)
        held = k in self.held
        b, hdr = self._body(label, k if held else self.held[0], labels)
        if head:
            c = self._within(b.chunks(k, missing_ok=True) if held else self._made_chunks(b, k), bounds)
            return Reply(200 if len(c) else 204, b"", "text/html", hdr)
        parts = b.sparsevol_parts(k, format=fmt, bounds=bounds) if held else self._made_parts(b, k, fmt, bounds, labels)
        first = next(parts, b"")  # NotFoundError here, before anything is sent: a 404
        if fmt != "rles":
            return Reply(200, b"", "application/octet-stream", hdr, _chain(first, parts))
        return Reply(200, b"", "application/octet-stream", hdr, _rles(first, parts, comp))

    def _within(self, c: np.ndarray, bounds) -> np.ndarray:
        n = self.pyramid.chunk
        return c if bounds is None else c[((c >= bounds[0] // n) & (c <= bounds[1] // n)).all(axis=1)]

    def _made_chunks(self, b: Body, k: int) -> np.ndarray:
        """Chunks of a made scale holding the body: parents of its chunks at the finest held
        scale whose made records list it."""
        f = self.held[0]
        c = b.chunks(f, missing_ok=True)
        if not len(c):
            return c
        parents = np.unique(c >> (k - f), axis=0)
        parents = parents[np.lexsort((parents[:, 0], parents[:, 1], parents[:, 2]))]
        target = np.uint64(b.id)
        keep = [p for p, rec in self.pyramid.records(k, parents)
                if ((rec.supervoxels if isinstance(b.labels, Supervoxels) else rec.labels) == target).any()]
        return np.asarray(keep, np.int64).reshape(-1, 3)

    def _made_parts(self, b: Body, k: int, fmt: str, bounds, labels) -> Iterator[bytes]:
        """Body.sparsevol_parts for a scale made on demand (the same encoders, the made blocks)."""
        n = self.pyramid.chunk
        c = self._within(self._made_chunks(b, k), bounds)
        if not len(c):
            raise b.not_found(k, why="within the bounds" if bounds is not None else "")
        target = np.uint64(b.id)
        buf = np.empty((n, n, n), np.uint64)

        def masks():
            for cc, rec in self.pyramid.records(k, c):
                self.pyramid.decode(rec, labels, buf)
                yield np.asarray(cc, np.int64), buf == target

        if fmt == "blocks":
            yield BLOCKS_HEADER.pack(n // 8, n // 8, n // 8, b.id)
            for cc, m in masks():
                yield binary_block(cc * n, m)
            return
        order = RunOrder(n, maxx=None if bounds is None or bounds[1][0] >= (1 << 31) - 1 else int(bounds[1][0]))
        for cc, m in masks():
            runs = runs_from_mask(m.T, cc * n) if m.any() else np.zeros((0, 4), np.int32)
            if bounds is not None:
                runs = clip_runs(runs, *bounds)
            done = order.add(cc, runs)
            if len(done):
                yield done.astype("<i4").tobytes()
        done = order.finish()
        if len(done):
            yield done.astype("<i4").tobytes()

    def ep_sparsevol_coarse(self, r: Request) -> Reply:
        need(r.args, 1, "a label")
        k = self._held_scale(r.query, "/sparsevol-coarse")
        b, head = self._body(label_arg(r.args[0]), k, labels_of(r.query))
        return Reply(200, b.sparsevol_coarse(bounds=parse_bounds(r.query)), "application/octet-stream", head)

    def ep_sparsevols_coarse(self, r: Request) -> Reply:
        need(r.args, 2, "<start label>/<end label>")
        a, z = label_arg(r.args[0], "start label"), label_arg(r.args[1], "end label")
        bounds = parse_bounds(r.query)
        bodies, _ = self._all_bodies(False)
        sel = bodies[(bodies >= np.uint64(a)) & (bodies <= np.uint64(z))]
        k = self.held[0]

        def stream() -> Iterator[bytes]:
            for v in sel.tolist():
                b, _ = self._body(int(v), k, Agglomerated())
                try:
                    data = b.sparsevol_coarse(bounds=bounds)
                except NotFoundError:
                    continue
                yield np.uint64(v).astype("<u8").tobytes() + data[8:]  # u64 label, i32 spans, the spans
        return Reply(200, b"", "application/octet-stream", {}, stream())

    # --- label indexes ----------------------------------------------------------------------------

    def _label_index(self, label: int) -> bytes | None:
        b, _ = self._body(label, self.held[0], Agglomerated())
        try:
            c, sv, n = b.supervoxel_counts()
        except NotFoundError:
            return None
        return encode_label_index(label, c, sv, n, last_mod_time=self.time)

    def ep_index(self, r: Request) -> Reply:
        need(r.args, 1, "a label")
        label = label_arg(r.args[0])
        if "mutid" in r.query:
            parse_int(r.query["mutid"], "mutid", lo=0, hi=(1 << 64) - 1)
            raise Gone(f"mutid={r.query['mutid']}: an export holds one version with no mutations")
        k = self._held_scale(r.query, "/index")
        b, head = self._body(label, k, labels_of(r.query))
        c, sv, n = b.supervoxel_counts()
        if parse_flag(r.query, "metadata-only"):
            text = (f'{{"num_voxels":{int(n.sum())},"last_mutid":0,"last_mod_time":"{self.time}",'
                    f'"last_mod_user":"","last_mod_app":""}}')
            return Reply(200, text.encode(), "application/json", head)
        return Reply(200, encode_label_index(label, c, sv, n, last_mod_time=self.time), "application/octet-stream",
                     head)

    def ep_indices(self, r: Request) -> Reply:
        ids = ids_body(r.body, limit=50_000)
        out = bytearray()
        for v in ids:
            msg = self._label_index(v) if v else None
            if msg is None:  # DVID: an empty index holding the label
                msg = b"\x10" + _varint(v)
            out += b"\x0a" + _varint(len(msg)) + msg
        return Reply(200, bytes(out), "application/octet-stream")

    def ep_indices_compressed(self, r: Request) -> Reply:
        raise BadRequest("/indices-compressed streams DVID's stored label index values, which an export does not "
                         "hold; ask /indices (the same indices as protobuf)")

    # --- listings ---------------------------------------------------------------------------------

    def _all_bodies(self, sizes: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """Every body of the export, sorted, and (when asked) its voxels at the finest held scale."""
        with self._lock:
            have = self._bodies
        if have is not None and (not sizes or have[1] is not None):
            return have
        if not sizes:
            bodies = np.unique(self.table().values)
            got: tuple[np.ndarray, np.ndarray | None] = (bodies[bodies != 0], None)
        elif self.index is not None and self.index.meta.get("labels") == "agglomerated":
            u, n = self.index.body_sizes()
            got = (u, n.astype(np.uint64))
        else:
            k = self.held[0]
            lo, hi = self.pyramid.box(k)
            log.info("listlabels sizes: counting every body of scale %d (give --label-index to skip this)", k)
            u, n = export_unique(self.ds, [lo.tolist(), hi.tolist()], scale=k, counts=True,
                                 fill_missing_shards=self.fill)
            keep = u != 0
            got = (np.asarray(u[keep], np.uint64), np.asarray(n[keep], np.uint64))
        with self._lock:
            self._bodies = got
        return got

    def ep_listlabels(self, r: Request) -> Reply:
        q = r.query
        start = parse_int(q.get("start", "0") or "0", "start", lo=0, hi=(1 << 64) - 1)
        number = parse_int(q.get("number", str(MAX_LISTLABELS)) or "0", "number", lo=0, hi=(1 << 64) - 1)
        number = min(number, MAX_LISTLABELS)
        sizes = q.get("sizes", "") == "true"
        bodies, counts = self._all_bodies(sizes)
        a = int(np.searchsorted(bodies, np.uint64(start)))
        sel = slice(a, a + number)
        if sizes:
            assert counts is not None
            data = np.stack([bodies[sel], counts[sel]], axis=1).astype("<u8").tobytes()
        else:
            data = bodies[sel].astype("<u8").tobytes()
        return Reply(200, data, "application/octet-stream")

    def ep_existing_labels(self, r: Request) -> Reply:
        bodies, _ = self._all_bodies(False)
        return Reply(200, id_list(bodies), "application/json")

    # --- mappings ---------------------------------------------------------------------------------

    def ep_mapping(self, r: Request) -> Reply:
        svs = ids_body(r.body)
        parse_flag(r.query, "nolookup")
        out = lookup(self.table(), svs) if svs else np.zeros(0, np.uint64)  # DVID: 0 for one that does not exist
        return Reply(200, id_list(out), "application/json", self._table_header())

    def ep_mappings(self, r: Request) -> Reply:
        fmt = r.query.get("format", "")
        if fmt not in ("", "binary", "text", "csv"):
            raise BadRequest(f"format={fmt!r}: give binary, or nothing for text")
        binary = fmt == "binary"
        t = self.table()

        def encode() -> Iterator[bytes]:
            for a in range(0, len(t.keys), 1 << 20):
                sv, b = t.keys[a:a + (1 << 20)], t.values[a:a + (1 << 20)]
                keep = sv != b  # DVID lists the non-identity mappings
                sv, b = sv[keep], b[keep]
                if binary:
                    yield np.stack([sv, b], axis=1).astype("<u8").tobytes()
                else:
                    yield "".join(f"{s} {v}\n" for s, v in zip(sv.tolist(), b.tolist(), strict=True)).encode()

        return Reply(200, b"", "application/octet-stream" if binary else "text/plain", self._table_header(), encode())

    # --- history: a snapshot has none -------------------------------------------------------------

    def ep_empty_log(self, r: Request) -> Reply:
        return Reply(200, b"[]", "application/json")

    def ep_history(self, r: Request) -> Reply:
        need(r.args, 3, "<label>/<from UUID>/<to UUID>")
        label_arg(r.args[0])
        return Reply(200, b"[]", "application/json")

    def ep_supervoxel_splits(self, r: Request) -> Reply:
        return Reply(200, f'["{self.uuid}",[]]'.encode(), "application/json")

    def ep_proximity(self, r: Request) -> Reply:
        # DVID's handler reads two labels (<a>/<b>), 404 when either has no index, and writes nothing
        # (its getProximity is a stub): the same answer here
        need(r.args, 2, "<label 1>/<label 2>")
        a = label_arg(r.args[0].split(",")[0], "label 1")
        b = label_arg(r.args[1], "label 2")
        if a == b:
            raise BadRequest("the two supplied labels were identical")
        self._exists(a)
        self._exists(b)
        return Reply(200, b"", "application/json")

    def ep_pseudocolor(self, r: Request) -> Reply:
        raise BadRequest("/pseudocolor hashes labels with Go's murmur3 into colours DVID does not document; "
                         "this server does not draw them (ask /raw/xy/... for png labels)")

    def ep_fvdb(self, r: Request) -> Reply:
        raise BadRequest("/fvdb writes NanoVDB grids, which this server does not encode; ask /sparsevol")


def _chain(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    yield first
    yield from rest


def _rles(first: bytes, rest: Iterator[bytes], comp: str) -> Iterator[bytes]:
    """Legacy rles: every span spooled (memory up to 16 MiB, then a temporary file), counted,
    then the header and the spans; DVID writes nothing at all when no span is left."""
    import tempfile
    import zlib

    with tempfile.SpooledTemporaryFile(max_size=_SPOOL) as spool:
        n = 0
        for piece in _chain(first, rest):
            spool.write(piece)
            n += len(piece)
        if not n:
            return
        spool.seek(0)
        head = HEADER.pack(0, 3, 0, 0, 0, n // 16)
        if comp == "lz4":  # one lz4 block of the whole answer, as DVID's golz4
            from .dvid_volume import lz4_block

            yield lz4_block(head + spool.read())
            return
        z = zlib.compressobj(1, zlib.DEFLATED, 31) if comp == "gzip" else None
        yield z.compress(head) if z is not None else head
        while True:
            piece = spool.read(_PIECE)
            if not piece:
                break
            yield z.compress(piece) if z is not None else piece
        if z is not None:
            yield z.flush()

