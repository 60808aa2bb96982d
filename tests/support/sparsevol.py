"""Reference sparsevol encoders, written the way DVID's Go code walks blocks (independent of
``formats.sparsevol``), and random body masks."""

from __future__ import annotations

import itertools
import struct

import numpy as np


def naive_dvid_bytes(mask: np.ndarray, offset, block: int, bounds=None) -> bytes:
    """DVID's sparsevol stream by loops over voxels (mask indexed [x, y, z]).

    ``bounds`` ((minx, miny, minz), (maxx, maxy, maxz)), inclusive, is DVID's exact bounded
    scan: blocks outside the block bounds are skipped, rows outside them not scanned, and a
    row scan stops at maxx, so a run reaching maxx waits in the buffer like one reaching the
    block's +x face (``writeRLEs`` with ``bounds.Voxel.Adjust``).
    """
    ox, oy, oz = (int(v) for v in offset)
    nx, ny, nz = mask.shape
    lo, hi = bounds if bounds is not None else ((-(2**31),) * 3, (2**31 - 1,) * 3)
    present = set()
    for x in range(nx):
        for y in range(ny):
            for z in range(nz):
                if mask[x, y, z]:
                    b = ((oz + z) // block, (oy + y) // block, (ox + x) // block)
                    if all(lo[a] // block <= b[2 - a] <= hi[a] // block for a in range(3)):
                        present.add(b)
    out: list[tuple[int, int, int, int]] = []
    buf: dict[tuple[int, int], list[int]] = {}  # (y, z) -> [x, y, z, length]
    prev = None

    def flush():
        for key in sorted(buf, key=lambda yz: (yz[1], yz[0])):
            out.append(tuple(buf[key]))
        buf.clear()

    for bz, by, bx in sorted(present):
        if prev is not None and (bz, by, bx - 1) != prev:
            flush()
        for z in range(max(bz * block, lo[2]), min((bz + 1) * block, hi[2] + 1)):
            for y in range(max(by * block, lo[1]), min((by + 1) * block, hi[1] + 1)):
                run = buf.pop((y, z), None)
                for x in range(max(bx * block, lo[0]), min((bx + 1) * block, hi[0] + 1)):
                    i, j, k = x - ox, y - oy, z - oz
                    fg = 0 <= i < nx and 0 <= j < ny and 0 <= k < nz and bool(mask[i, j, k])
                    if fg:
                        if run is None:
                            run = [x, y, z, 1]
                        else:
                            run[3] += 1
                    elif run is not None:
                        out.append(tuple(run))
                        run = None
                if run is not None:
                    buf[(y, z)] = run
        prev = (bz, by, bx)
    flush()
    head = struct.pack("<BBBBII", 0, 3, 0, 0, 0, len(out))
    return head + b"".join(struct.pack("<4i", *r) for r in out)


def random_body(rng: np.random.Generator, shape) -> np.ndarray:
    """Blobs, solid boxes and noise: runs across block faces, solid blocks, single voxels."""
    m = rng.random(shape) < 0.15
    for _ in range(4):
        lo = [int(rng.integers(0, s)) for s in shape]
        hi = [min(s, lo_ + int(rng.integers(1, s))) for lo_, s in zip(lo, shape, strict=True)]
        m[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]] = rng.random() < 0.8
    return m


def reference_rles(mask: np.ndarray, offset, block: int = 64) -> bytes:
    """DVID's sparsevol stream, block by block and row by row as ``labels.WriteRLEs`` writes it.

    A run reaching a block's +x face waits in a buffer keyed by its row and continues in the
    x-successor block; the buffer is flushed (here sorted by z, y) when the next block holding
    the body is not that successor. ``mask`` is indexed [x, y, z] from ``offset``.
    """
    off = np.asarray(offset, np.int64)
    nz = np.argwhere(mask) + off
    present = sorted({(int(z), int(y), int(x)) for x, y, z in np.unique(nz // block, axis=0)})
    out: list[tuple[int, int, int, int]] = []
    buf: dict[tuple[int, int], list[int]] = {}
    prev = None

    def flush():
        for key in sorted(buf, key=lambda yz: (yz[1], yz[0])):
            out.append(tuple(buf[key]))
        buf.clear()

    for bz, by, bx in present:
        if prev is not None and (bz, by, bx - 1) != prev:
            flush()
        lo = np.array([bx, by, bz]) * block
        sub = np.zeros((block,) * 3, bool)  # [x, y, z] of this block
        a = np.maximum(lo, off)
        b = np.minimum(lo + block, off + mask.shape)
        if (b > a).all():
            sub[a[0] - lo[0]:b[0] - lo[0], a[1] - lo[1]:b[1] - lo[1], a[2] - lo[2]:b[2] - lo[2]] = \
                mask[a[0] - off[0]:b[0] - off[0], a[1] - off[1]:b[1] - off[1], a[2] - off[2]:b[2] - off[2]]
        for z in range(block):
            for y in range(block):
                key = (lo[1] + y, lo[2] + z)
                run = buf.pop(key, None)
                row = sub[:, y, z]
                if not row.any():
                    if run is not None:
                        out.append(tuple(run))
                    continue
                d = np.diff(np.concatenate([[0], row.astype(np.int8), [0]]))
                for s, e in zip(np.flatnonzero(d == 1).tolist(), np.flatnonzero(d == -1).tolist(), strict=True):
                    if s > 0 and run is not None:
                        out.append(tuple(run))
                        run = None
                    if run is None:
                        run = [int(lo[0]) + s, int(key[0]), int(key[1]), e - s]
                    else:
                        run[3] += e - s
                    if e < block:
                        out.append(tuple(run))
                        run = None
                if run is not None:
                    buf[key] = run
        prev = (bz, by, bx)
    flush()
    return struct.pack("<BBBBII", 0, 3, 0, 0, 0, len(out)) + b"".join(struct.pack("<4i", *r) for r in out)


def reference_coarse(mask: np.ndarray, offset, block: int = 64) -> bytes:
    blocks = np.unique((np.argwhere(mask) + np.asarray(offset)) // block, axis=0)
    spans: list[list[int]] = []
    for bx, by, bz in sorted(blocks.tolist(), key=lambda c: (c[2], c[1], c[0])):
        if spans and spans[-1][1:3] == [by, bz] and spans[-1][0] + spans[-1][3] == bx:
            spans[-1][3] += 1
        else:
            spans.append([bx, by, bz, 1])
    return struct.pack("<BBBBII", 0, 3, 0, 0, 0, len(spans)) + b"".join(struct.pack("<4i", *s) for s in spans)


def naive_binary_blocks(mask_zyx, offset) -> bytes:
    """``WriteBinaryBlock`` by loops: flags per sub-block, bits LSB first, x fastest."""
    out = bytearray(struct.pack("<3i", *offset))
    if mask_zyx.all():
        return bytes(out + b"\x01")
    if not mask_zyx.any():
        return bytes(out + b"\x00")
    out += b"\x02"
    gz, gy, gx = (n // 8 for n in mask_zyx.shape)
    for sz, sy, sx in itertools.product(range(gz), range(gy), range(gx)):
        sub = mask_zyx[sz * 8:sz * 8 + 8, sy * 8:sy * 8 + 8, sx * 8:sx * 8 + 8]
        if sub.all():
            out += b"\x01"
        elif not sub.any():
            out += b"\x00"
        else:
            bits = bytearray(64)
            for i, v in enumerate(sub.reshape(-1).tolist()):  # z, y, x with x fastest
                if v:
                    bits[i // 8] |= 1 << (i % 8)
            out += b"\x02" + bits
    return bytes(out)


# --------------------------------------------------------------------------- reading DVID's bytes back


def decode(data: bytes) -> np.ndarray:
    """Runs (x, y, z, length) of a legacy ``rles`` sparse volume (fine or coarse), in stream order;
    AssertionError unless the header says a 3-d binary sparse volume with runs along x."""
    desc, ndim, run_dim, _, _, n = struct.unpack_from("<BBBBII", data, 0)
    assert (desc, ndim, run_dim) == (0, 3, 0) and len(data) == 12 + 16 * n, (desc, ndim, run_dim, n, len(data))
    return np.frombuffer(data, "<i4", 4 * n, 12).reshape(n, 4).astype(np.int32)


def mask_from_runs(runs, lo, hi) -> np.ndarray:
    """Boolean mask ``[x, y, z]`` of the box ``[lo, hi)`` with the runs' voxels set, voxel by run."""
    lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
    out = np.zeros(tuple(int(v) for v in hi - lo), bool)
    for x, y, z, n in np.asarray(runs, np.int64).tolist():
        if lo[1] <= y < hi[1] and lo[2] <= z < hi[2]:
            a, b = max(x, lo[0]), min(x + n, hi[0])
            out[a - lo[0]:max(b - lo[0], a - lo[0]), y - lo[1], z - lo[2]] = True
    return out


def decode_blocks(data: bytes) -> tuple[int, list[tuple[tuple[int, int, int], np.ndarray]]]:
    """DVID's ``sparsevol?format=blocks`` bytes read back: the label and ``[((x, y, z), mask (z, y, x))]``."""
    gx, gy, gz, label = struct.unpack_from("<IIIQ", data, 0)
    p, out = 20, []
    while p < len(data):
        off, flag = struct.unpack_from("<3i", data, p), data[p + 12]
        p += 13
        m = np.full((8 * gz, 8 * gy, 8 * gx), flag == 1)
        if flag == 2:
            for sz, sy, sx in itertools.product(range(gz), range(gy), range(gx)):
                f = data[p]
                p += 1
                sub = np.full(512, f == 1)
                if f == 2:
                    sub = np.unpackbits(np.frombuffer(data, np.uint8, 64, p), bitorder="little").astype(bool)
                    p += 64
                assert f in (0, 1, 2), f
                m[8 * sz:8 * sz + 8, 8 * sy:8 * sy + 8, 8 * sx:8 * sx + 8] = sub.reshape(8, 8, 8)
        assert flag in (0, 1, 2), flag
        out.append((off, m))
    return int(label), out
