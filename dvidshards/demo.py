"""``dvidshards demo``: write a realistic synthetic export, open it, read across shards, save a PNG."""

from __future__ import annotations

import os
import struct
import tempfile
import time
import zlib

import numpy as np

__all__ = ["label_colors", "run_demo", "write_png"]


def label_colors(labels: np.ndarray) -> np.ndarray:
    """A random-looking but stable RGB colour per label (0 is black), shape labels.shape + (3,)."""
    h = np.asarray(labels, np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    h ^= h >> np.uint64(29)
    rgb = np.stack([(h >> np.uint64(s)) & np.uint64(0xFF) for s in (0, 8, 16)], axis=-1).astype(np.uint8)
    rgb = rgb // 2 + 96  # keep colours bright
    rgb[np.asarray(labels) == 0] = 0
    return rgb


def write_png(path: str, rgb: np.ndarray) -> None:
    """Write an (h, w, 3) uint8 image as PNG (zlib only, no imaging dependency)."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + np.ascontiguousarray(rgb[r]).tobytes() for r in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))
    with open(path, "wb") as f:
        f.write(png)


def run_demo(out_dir: str | None = None, *, size=(512, 448, 256), seed: int = 7, png: str | None = None,
             echo=print) -> dict:
    """Write a synthetic multi-scale export, read a box across shard boundaries, save a slice PNG.

    Returns a dict of what was read (for tests and notebooks).
    """
    import dvidshards
    from dvidshards.testing.synthetic import neuron_volume
    from dvidshards.writer import write_export

    out_dir = out_dir or tempfile.mkdtemp(prefix="dvidshards-demo-")
    export = os.path.join(out_dir, "export")
    t = time.perf_counter()
    sv, mapping = neuron_volume(size, n_bodies=40, svs_per_body=6, seed=seed)
    spec = write_export(sv, export, mapping=mapping, scales=3, resolution=(8, 8, 8), shard_chunks=2,
                        overwrite=True)
    with open(os.path.join(out_dir, "spec.json"), "w") as f:  # DVID writes no spec: keep it beside
        import json
        json.dump(spec, f, indent=1)
    ds = dvidshards.Dataset(export, spec=spec)
    n_shards = [len(ds.shards(s.index)) for s in ds.scales]
    echo(f"wrote {export}: {size} voxels, {len(mapping)} supervoxels in {len(np.unique(mapping[:, 1]))} bodies, "
         f"scales {[s.index for s in ds.scales]}, shard files per scale {n_shards} "
         f"({time.perf_counter() - t:.1f} s)")

    # a box that crosses shard boundaries (shards are 128 voxels) on every axis
    box = np.s_[60:380, 100:300, 90:210]
    result = {"export": export, "spec": spec, "box": box}
    for labels in ("agglomerated", "supervoxels"):
        # DVID writes no shard file where every block is background: read those as 0
        vol = dvidshards.open(export, scale=0, labels=labels, spec=spec, fill_missing_shards=True)
        t = time.perf_counter()
        a = vol[box].read(order="F").result()
        dt = time.perf_counter() - t
        ids = np.unique(a)
        echo(f"{labels:>12}: read {a.shape} (x,y,z) in {dt * 1000:.0f} ms, {len(ids) - (ids[0] == 0)} ids, "
             f"{(a == 0).mean():.0%} background, exact: {np.array_equal(a, _expected(sv, mapping, box, labels))}")
        result[labels] = a
    s1 = dvidshards.open(export, scale=1, spec=spec, fill_missing_shards=True)
    small = s1[box[0].start // 2:box[0].stop // 2, box[1].start // 2:box[1].stop // 2,
               box[2].start // 2:box[2].stop // 2].read(order="F").result()
    echo(f"       scale 1: {small.shape} at 16 nm, {len(np.unique(small)) - 1} bodies")
    sup = result["supervoxels"]
    z = max(range(sup.shape[2]), key=lambda k: len(np.unique(sup[:, :, k])))  # the busiest slice
    pic = np.concatenate([label_colors(result["agglomerated"][:, :, z].T), np.full((a.shape[1], 8, 3), 255, np.uint8),
                          label_colors(result["supervoxels"][:, :, z].T)], axis=1)
    png = png or os.path.join(out_dir, "slice.png")
    write_png(png, pic)
    echo(f"saved {png}: z={box[2].start + z}, agglomerated bodies (left) beside supervoxels (right)")
    result["png"] = png
    return result


def _expected(sv, mapping, box, labels):
    ref = np.asarray(sv[box])
    if labels == "supervoxels":
        return ref
    from dvidshards.formats.mapping import LabelMapping

    return LabelMapping.from_any(mapping)(ref)
