"""serve-dvid's voxels: every scale of the spec, and the volume endpoints of a labelmap instance.

`Pyramid` gives the block of any chunk at any scale the spec lists: from the export (or a
``downsample`` output opened with it) where a scale is held, otherwise made on demand from the
scale below by DVID's rule (`dvidshards.bodies.MadeScales`, what ``Body.skeleton`` makes a scale
with; down to the finest held scale) and kept in a bounded cache, so an s0-only export answers every level. A
scale finer than the finest held one cannot be made and is refused naming the held scales.

`VolumeEndpoints` answers ``raw`` and ``isotropic`` (3-d: uint64 z, y, x; ``compression=`` gzip,
lz4, google, googlegzip; 2-d ``png``/``jpg`` images as DVID draws labels), ``blocks`` and
``specificblocks`` (``compression=`` blocks, gzip, uncompressed, lz4), ``label`` and ``labels``.
As in DVID, voxels outside the volume (or of a shard DVID never wrote) are 0, absent blocks are
left out of block streams, and a block outside the volume is skipped.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np

from ..bodies import MadeScales, Rec
from ..errors import NotExportedError, SpecError
from ..formats.codec import encode_block
from ..formats.cseg import transcode
from ..formats.labels import Agglomerated, LabelSource
from ..query import label_at
from .dvid_base import (
    BadRequest,
    Reply,
    Request,
    gzip_bytes,
    id_list,
    labels_of,
    need,
    parse_point,
    points_body,
)

__all__ = ["MAX_RAW_VOXELS", "Pyramid", "Rec", "VolumeEndpoints"]

MAX_RAW_VOXELS = 1 << 24  # /raw: 128 MiB of uint64 at most per request
_MADE_CACHE = 256 << 20  # bytes of made blocks kept
MADE_LIMIT = 1 << 12  # chunks of the held scale a chunk of a made scale may be made from on demand


def lz4_block(data: bytes) -> bytes:
    """An lz4 *block* (no frame, no size prefix), as DVID's golz4 writes."""
    import lz4.block  # optional (the serve extra): imported when an lz4 answer is made

    return lz4.block.compress(data, mode="default", store_size=False)


class Pyramid(MadeScales):
    """The blocks of every scale of a dataset's spec (see the module docstring): ``held`` the scales
    the export holds (finest first), ``fill`` a missing shard file read as background (else
    ``MissingShardError``), ``cache_bytes`` of made blocks kept."""

    def __init__(self, ds, held: list[int], *, fill: bool = True, cache_bytes: int = _MADE_CACHE):
        super().__init__(ds, held, fill=fill)
        self.cache_bytes = int(cache_bytes)
        self._made: OrderedDict[tuple, Rec | None] = OrderedDict()
        self._made_bytes = 0
        cs = {tuple(int(v) for v in ds.scale(k).chunk_size) for k in self.served}
        if len(cs) != 1 or len(next(iter(cs))) != 3 or len(set(next(iter(cs)))) != 1:
            raise SpecError(f"serve-dvid needs one cubic chunk size at every scale, got {sorted(cs)}")
        self.chunk = int(next(iter(cs))[0])

    @property
    def max_level(self) -> int:
        return max(self.served)

    def scale(self, q) -> int:
        """The ``scale`` parameter: any scale of the spec from the finest held one up."""
        text = q.get("scale", "0")
        try:
            k = int(text)
        except ValueError:
            raise BadRequest(f"scale={text!r}: give a scale number") from None
        if k not in self.served:
            if 0 <= k < self.held[0] and k in [s.index for s in self.ds.scales]:
                raise BadRequest(f"scale={k}: this export holds scales {self.held}; scale {k} is finer than its "
                                 f"finest and cannot be made from it")
            raise BadRequest(f"scale={k}: this export holds scales {self.held} (serving 0..{self.max_level})"
                             if self.held[0] == 0 else f"scale={k}: this export holds scales {self.held}")
        return k

    def box(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The scale's volume, [lo, hi) voxels."""
        s = self.ds.scale(k)
        lo = np.asarray(s.voxel_offset, np.int64)
        return lo, lo + np.asarray(s.size, np.int64)

    def grid(self, k: int) -> np.ndarray:
        return np.asarray(self.ds.scale(k).grid, np.int64)

    def made(self, k: int, c: tuple[int, int, int], present: np.ndarray | None = None) -> Rec | None:
        """`MadeScales.made`, cached, and refused when it would need more than ``MADE_LIMIT`` chunks
        of the held scale (those the export holds under it), naming ``dvidshards downsample``."""
        key = (k, c)
        with self._lock:
            if key in self._made:
                self._made.move_to_end(key)
                return self._made[key]
        h = max(v for v in self.held if v < k)
        if present is None:
            present = self.present(h, c, k - h)
        if len(present) > MADE_LIMIT:
            raise NotExportedError(
                f"scale {k} is not in this export, and its chunk {c} would be made from {len(present)} chunks of "
                f"scale {h} (at most {MADE_LIMIT} on demand): make the scales with dvidshards downsample and "
                f"serve its output")
        rec = super().made(k, c, present)
        with self._lock:
            if key not in self._made:
                self._made[key] = rec
                self._made_bytes += 64 + (len(rec.block) + 16 * len(rec.supervoxels) if rec is not None else 0)
                while self._made_bytes > self.cache_bytes and len(self._made) > 1:
                    _, old = self._made.popitem(last=False)
                    self._made_bytes -= 64 + (len(old.block) + 16 * len(old.supervoxels) if old is not None else 0)
        return rec

    def cached(self, k: int, point, src: LabelSource) -> bool:
        """Whether the block holding a point is in memory (outside the volume: nothing to read)."""
        p = np.asarray(point, np.int64)
        lo, hi = self.box(k)
        if not ((p >= lo) & (p < hi)).all():
            return True
        c = tuple(int(v) for v in p // self.chunk)
        if k not in self.held:
            return (k, c) in self._made
        reader = self.ds.reader(k, labels=src, fill_missing_shards=self.fill)
        try:
            reader.cache.peek(reader.scale.shard_origin(*c))
        except KeyError:
            return False
        return True

    # --- voxels ---------------------------------------------------------------------------------

    def decode(self, rec: Rec, src: LabelSource, out: np.ndarray) -> None:  # dvid_labelmap's
        rec.decode(src, out)

    def block(self, k: int, c) -> np.ndarray | None:
        """Chunk c of scale k as (z, y, x) bodies; None when no block is there."""
        rec = self.record(k, tuple(int(v) for v in c))
        if rec is None:
            return None
        out = np.empty((self.chunk,) * 3, np.uint64)
        rec.decode(Agglomerated(), out)
        return out

    def read(self, k: int, lo, hi, src: LabelSource) -> np.ndarray:
        """The voxels [lo, hi) of a scale as an (x, y, z) uint64 array, 0 outside the volume."""
        lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
        out = np.zeros(tuple(int(v) for v in hi - lo), np.uint64, order="F")
        vlo, vhi = self.box(k)
        a, b = np.maximum(lo, vlo), np.minimum(hi, vhi)
        if (b <= a).any():
            return out
        dst = out[a[0] - lo[0]:b[0] - lo[0], a[1] - lo[1]:b[1] - lo[1], a[2] - lo[2]:b[2] - lo[2]]
        if k in self.held:
            self.ds.read([a.tolist(), b.tolist()], scale=k, labels=src, out=dst, fill_missing_shards=self.fill)
            return out
        n = self.chunk
        c0, c1 = a // n, -(-b // n)
        chunks = np.stack(np.meshgrid(*[np.arange(c0[i], c1[i]) for i in range(3)], indexing="ij"), -1).reshape(-1, 3)
        buf = np.empty((n, n, n), np.uint64)
        for c, rec in self.records(k, chunks):
            rec.decode(src, buf)
            org = np.asarray(c, np.int64) * n
            p, q = np.maximum(a, org), np.minimum(b, org + n)
            dst[p[0] - a[0]:q[0] - a[0], p[1] - a[1]:q[1] - a[1], p[2] - a[2]:q[2] - a[2]] = \
                buf[p[2] - org[2]:q[2] - org[2], p[1] - org[1]:q[1] - org[1], p[0] - org[0]:q[0] - org[0]].T
        return out

    def labels_at(self, points, k: int, src: LabelSource) -> np.ndarray:
        """Labels at (n, 3) points of a scale; 0 outside the volume and where no block is."""
        p = np.asarray(points, np.int64).reshape(-1, 3)
        lo, hi = self.box(k)
        inside = ((p >= lo) & (p < hi)).all(axis=1)
        out = np.zeros(len(p), np.uint64)
        if not inside.any():
            return out
        if k in self.held:
            out[inside] = label_at(self.ds, p[inside], scale=k, labels=src, fill_missing_shards=self.fill)
            return out
        n = self.chunk
        idx = np.flatnonzero(inside)
        ch = p[idx] // n
        buf = np.empty((n, n, n), np.uint64)
        for c in np.unique(ch, axis=0).tolist():
            rec = self.made(k, tuple(c))
            if rec is None:
                continue
            rec.decode(src, buf)
            sel = idx[(ch == c).all(axis=1)]
            q = p[sel] - np.asarray(c, np.int64) * n
            out[sel] = buf[q[:, 2], q[:, 1], q[:, 0]]
        return out


# --------------------------------------------------------------------------- images


def png_labels(vol_yx: np.ndarray) -> bytes:
    """DVID's PNG of a label slice: each uint64 (little-endian bytes) as one 16-bit RGBA pixel
    whose samples are those bytes read two at a time (Go's NRGBA64 over the raw labels)."""
    h, w = vol_yx.shape
    rows = np.ascontiguousarray(vol_yx.astype("<u8", copy=False)).view(np.uint8).reshape(h, 8 * w)
    raw = np.concatenate([np.zeros((h, 1), np.uint8), rows], axis=1).tobytes()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 6, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def jpg_labels(vol_yx: np.ndarray, quality: int) -> bytes:
    """DVID's JPEG of a label slice: the 8-bit RGB Go's encoder takes from those pixels
    (alpha-premultiplied), encoded with Pillow (the bytes differ from Go's encoder)."""
    try:
        from PIL import Image
    except ImportError:
        raise BadRequest("format jpg: this server has no JPEG encoder (pip install pillow); ask for png") from None
    import io

    px = np.ascontiguousarray(vol_yx.astype("<u8", copy=False)).view(np.uint8).reshape(*vol_yx.shape, 8)
    s = (px[..., 0::2].astype(np.uint32) << 8) | px[..., 1::2]  # R, G, B, A samples (16 bits)
    rgb = ((s[..., :3] * s[..., 3:4]) // 0xFFFF >> 8).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buf, "JPEG", quality=quality)
    return buf.getvalue()


_PLANES = {"xy": (0, 1), "xz": (0, 2), "yz": (1, 2), "0_1": (0, 1), "0_2": (0, 2), "1_2": (1, 2)}


# --------------------------------------------------------------------------- endpoints


class VolumeEndpoints:
    """``raw``, ``isotropic``, ``blocks``, ``specificblocks``, ``label``, ``labels`` of one instance."""

    def __init__(self, pyramid: Pyramid, resolution):
        self.pyr = pyramid
        self.res = [float(v) for v in resolution] if resolution is not None else [1.0, 1.0, 1.0]
        self._zero_cseg: dict[tuple, bytes] = {}

    def routes(self) -> dict:
        return {"raw": self.ep_raw, "isotropic": self.ep_isotropic, "blocks": self.ep_blocks,
                "specificblocks": self.ep_specificblocks, "label": self.ep_label, "labels": self.ep_labels}

    # --- points ---------------------------------------------------------------------------------

    def quick_label(self, r: Request) -> bool:
        """Whether ``label``'s point is in a shard (or made block) in memory."""
        try:
            k, p = self.pyr.scale(r.query), parse_point(r.args[0]) if r.args else None
        except BadRequest:
            return True  # answered at once
        return p is None or self.pyr.cached(k, p, labels_of(r.query))

    def ep_label(self, r: Request) -> Reply:
        need(r.args, 1, "a coordinate x_y_z")
        p = parse_point(r.args[0])
        v = self.pyr.labels_at([p], self.pyr.scale(r.query), labels_of(r.query))
        return Reply(200, f'{{"Label": {int(v[0])}}}'.encode())

    def ep_labels(self, r: Request) -> Reply:
        pts = points_body(r.body)
        k, src = self.pyr.scale(r.query), labels_of(r.query)
        v = self.pyr.labels_at(pts, k, src) if len(pts) else np.zeros(0, np.uint64)
        return Reply(200, id_list(v))

    # --- raw and isotropic ----------------------------------------------------------------------

    def ep_raw(self, r: Request) -> Reply:
        return self._volume(r, isotropic=False)

    def ep_isotropic(self, r: Request) -> Reply:
        return self._volume(r, isotropic=True)

    def _volume(self, r: Request, isotropic: bool) -> Reply:
        need(r.args, 3, "<dims>/<size>/<offset>, e.g. 0_1_2/64_64_64/0_0_0")
        dims, fmt = r.args[0], (r.args[3] if len(r.args) > 3 else "")
        q = r.query
        k, src = self.pyr.scale(q), labels_of(q)
        if "roi" in q and q["roi"]:
            raise BadRequest(f"roi={q['roi']!r}: this server has no roi instances")
        if dims in ("0_1_2", "xyz"):
            return self._raw3(r.args[1], r.args[2], fmt, q.get("compression", ""), k, src)
        if dims in _PLANES:
            return self._image(_PLANES[dims], r.args[1], r.args[2], fmt, k, src, isotropic)
        raise BadRequest(f"dims {dims!r}: give 0_1_2 (a subvolume) or a plane (xy, xz, yz, 0_1, 0_2, 1_2)")

    def _raw3(self, size_text: str, off_text: str, fmt: str, comp: str, k: int, src) -> Reply:
        size, off = parse_point(size_text, "size"), parse_point(off_text, "offset")
        if any(v <= 0 for v in size):
            raise BadRequest(f"size {size_text}: give positive sizes")
        if fmt not in ("", "octet-stream", "raw"):
            raise BadRequest(f"format {fmt!r}: a subvolume is served as raw uint64 (octet-stream)")
        if math.prod(int(v) for v in size) > MAX_RAW_VOXELS:  # Python ints: numpy's product wraps
            raise BadRequest(f"size {size_text}: more than {MAX_RAW_VOXELS} voxels; ask for smaller pieces "
                             f"(or /blocks, streamed)")
        if comp not in ("", "gzip", "lz4", "google", "googlegzip"):
            raise BadRequest(f"compression={comp!r}: give gzip, lz4, google or googlegzip (or none)")
        if comp.startswith("google"):
            data = self._cseg(k, src, off, size)
            if comp == "google":
                return Reply(200, data, "application/octet-stream")
            return Reply(200, gzip_bytes(data), "application/octet-stream", {"Content-Encoding": "gzip"})
        vol = self.pyr.read(k, off, [a + n for a, n in zip(off, size, strict=True)], src)
        raw = np.ascontiguousarray(vol.T).astype("<u8", copy=False).tobytes()  # z, y, x with x fastest
        if comp == "gzip":
            raw = gzip_bytes(raw)
        elif comp == "lz4":
            raw = lz4_block(raw)
        return Reply(200, raw, "application/octet-stream")

    def _cseg(self, k: int, src, off, size) -> bytes:
        """neuroglancer's compressed_segmentation of a box (a block-aligned chunk is transcoded
        from its DVID block without decoding voxels)."""
        if any(v % 8 for v in size):
            raise BadRequest(f"size {'_'.join(map(str, size))}: compression=google needs sizes that are multiples "
                             f"of 8 (as DVID)")
        if max(size) > 1024:
            raise BadRequest(f"size {'_'.join(map(str, size))}: compression=google boxes go up to 1024 voxels "
                             f"per axis here; ask for smaller pieces")
        n = self.pyr.chunk
        if list(size) == [n, n, n] and not any(v % n for v in off):
            vlo, vhi = self.pyr.box(k)
            o = np.asarray(off, np.int64)
            inside = ((o >= vlo) & (o + n <= vhi)).all()
            rec = self.pyr.record(k, tuple(int(v) // n for v in off)) if inside else None
            if rec is not None:
                return transcode(rec.block, rec.palette(src))
            if inside:
                return self._zeros((n, n, n))
        vol = self.pyr.read(k, off, [a + n for a, n in zip(off, size, strict=True)], src)
        return transcode(encode_block(np.ascontiguousarray(vol.T)))

    def _zeros(self, shape) -> bytes:
        data = self._zero_cseg.get(shape)
        if data is None:
            data = self._zero_cseg[shape] = transcode(encode_block(np.zeros(shape, np.uint64)))
        return data

    def _image(self, plane, size_text: str, off_text: str, fmt: str, k: int, src, isotropic: bool) -> Reply:
        w, h = parse_point(size_text, "size", n=2)
        off = parse_point(off_text, "offset")
        if w <= 0 or h <= 0:
            raise BadRequest(f"size {size_text}: give positive sizes")
        kind, _, qual = fmt.partition(":")
        if kind not in ("", "png", "jpg", "jpeg"):
            raise BadRequest(f"format {fmt!r}: a label slice is served as png or jpg[:quality]")
        quality = 80
        if qual:
            try:
                quality = int(qual)
            except ValueError:
                raise BadRequest(f"format {fmt!r}: the jpg quality must be a number") from None
        a, b = plane
        sw, sh = w, h
        ra, rb = self.res[a], self.res[b]
        if isotropic and ra != rb:  # DVID reads the slice at the coarser axis's voxel count, then resizes
            if ra < rb:
                sh = int(h * ra / rb + 0.5)
            else:
                sw = int(w * rb / ra + 0.5)
        if w * h > MAX_RAW_VOXELS:
            raise BadRequest(f"size {size_text}: more than {MAX_RAW_VOXELS} pixels")
        hi = list(off)
        hi[a] += max(sw, 1)
        hi[b] += max(sh, 1)
        for i in range(3):
            if i not in plane:
                hi[i] += 1
        vol = self.pyr.read(k, off, hi, src)
        sl = np.moveaxis(vol, (a, b), (0, 1)).reshape(vol.shape[a], vol.shape[b]).T  # (rows b, cols a)
        if (sw, sh) != (w, h):  # nearest neighbour, as Go's resize of non-interpolable labels
            ys = np.minimum((np.arange(h) * sl.shape[0]) // h, sl.shape[0] - 1)
            xs = np.minimum((np.arange(w) * sl.shape[1]) // w, sl.shape[1] - 1)
            sl = sl[ys][:, xs]
        if kind in ("", "png"):
            return Reply(200, png_labels(sl), "image/png")
        return Reply(200, jpg_labels(sl, quality), "image/jpeg")

    # --- blocks ---------------------------------------------------------------------------------

    @staticmethod
    def _compression(q, default: str) -> str:
        comp = q.get("compression", "") or default
        if comp not in ("blocks", "gzip", "uncompressed", "lz4"):
            raise BadRequest(f"compression={comp!r}: give blocks, gzip, uncompressed or lz4")
        return comp

    def _stream(self, k: int, src, chunks: np.ndarray, comp: str) -> Iterator[bytes]:
        """``/blocks`` records of the chunks present, in the given order, a few at a time."""
        n = self.pyr.chunk
        out: list[bytes] = []
        size = 0
        for c, rec in self.pyr.records(k, chunks):
            data = self._payload(rec, src, comp, n)
            out.append(struct.pack("<4i", c[0], c[1], c[2], len(data)) + data)
            size += len(data)
            if size > 1 << 20:
                yield b"".join(out)
                out, size = [], 0
        if out:
            yield b"".join(out)

    def _payload(self, rec: Rec, src, comp: str, n: int) -> bytes:
        if comp == "blocks":  # DVID's native block, its label list mapped unless supervoxels, gzipped
            block = rec.block.tobytes()
            pal = rec.palette(src)
            if pal is not None:
                m = int.from_bytes(block[12:16], "little")
                block = block[:16] + np.asarray(pal, "<u8").tobytes() + block[16 + 8 * m:]
            return gzip_bytes(block)
        vol = np.empty((n, n, n), np.uint64)
        rec.decode(src, vol)
        raw = vol.astype("<u8", copy=False).tobytes()
        if comp == "gzip":
            return gzip_bytes(raw)
        return raw if comp == "uncompressed" else lz4_block(raw)

    def ep_specificblocks(self, r: Request) -> Reply:
        q = r.query
        k, src = self.pyr.scale(q), labels_of(q)
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
        if any(not -(1 << 31) <= x < 1 << 31 for x in v):
            raise BadRequest("blocks: a block coordinate is beyond 32 bits")
        c = np.asarray(v, np.int64).reshape(-1, 3)
        return Reply(200, b"", "application/octet-stream", {}, self._stream(k, src, c, comp))

    def ep_blocks(self, r: Request) -> Reply:
        need(r.args, 2, "<size>/<offset>, e.g. 128_128_128/0_0_64")
        q = r.query
        k, src = self.pyr.scale(q), labels_of(q)
        comp = self._compression(q, "lz4")
        size, off = parse_point(r.args[0], "size"), parse_point(r.args[1], "offset")
        n = self.pyr.chunk
        if any(v <= 0 for v in size):
            raise BadRequest(f"size {r.args[0]}: give positive sizes")
        if any(v % n for v in size) or any(v % n for v in off):
            raise BadRequest(f"size {r.args[0]} / offset {r.args[1]}: the subvolume must be block aligned "
                             f"({[n, n, n]})")
        lo = np.asarray(off, np.int64) // n
        hi = lo + np.asarray(size, np.int64) // n
        g = self.pyr.grid(k)
        lo, hi = np.maximum(lo, 0), np.minimum(hi, g)
        return Reply(200, b"", "application/octet-stream", {}, self._box_stream(k, src, lo, hi, comp))

    def _box_stream(self, k: int, src, lo: np.ndarray, hi: np.ndarray, comp: str) -> Iterator[bytes]:
        if (hi <= lo).any():
            return
        xs = np.arange(lo[0], hi[0], dtype=np.int64)
        for z in range(int(lo[2]), int(hi[2])):
            for y in range(int(lo[1]), int(hi[1])):
                row = np.stack([xs, np.full_like(xs, y), np.full_like(xs, z)], axis=1)
                yield from self._stream(k, src, row, comp)
