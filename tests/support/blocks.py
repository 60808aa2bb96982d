"""DVID blocks built independently of the codec under test, and the blocks an export holds."""

from __future__ import annotations

import struct

import numpy as np
import pyarrow as pa
import zstandard


def build_block(grid, labels, subblocks=None, pad=b""):
    """Bytes of a block from its parts.

    grid: (gz, gy, gx); labels: the block label list; subblocks: one (indices, values) per
    sub-block in z, y, x order, values a length-512 array of positions into indices (ignored
    when len(indices) <= 1). Returns (block bytes, expected (z, y, x) volume).
    """
    gz, gy, gx = grid
    labels = np.asarray(labels, dtype=np.uint64)
    head = struct.pack("<4I", gx, gy, gz, len(labels)) + labels.astype("<u8").tobytes()
    vol = np.empty((8 * gz, 8 * gy, 8 * gx), dtype=np.uint64)
    if subblocks is None:
        assert len(labels) == 1
        vol[...] = labels[0]
        return head + pad, vol
    assert len(subblocks) == gz * gy * gx
    nsb, idx, vals = [], [], []
    for i, (ix, v) in enumerate(subblocks):
        sz, sy, sx = np.unravel_index(i, grid)
        view = vol[8 * sz : 8 * sz + 8, 8 * sy : 8 * sy + 8, 8 * sx : 8 * sx + 8]
        ix = np.asarray(ix, dtype=np.int64)
        nsb.append(len(ix))
        idx.extend(ix.tolist())
        if len(ix) == 0:
            view[...] = 0
        elif len(ix) == 1:
            view[...] = labels[ix[0]]
        else:
            v = np.asarray(v, dtype=np.int64)
            b = (len(ix) - 1).bit_length()
            bits = ((v[:, None] >> np.arange(b - 1, -1, -1)) & 1).astype(np.uint8)
            vals.append(np.packbits(bits.ravel()).tobytes())
            view[...] = labels[ix[v]].reshape(8, 8, 8)
    body = np.asarray(nsb, "<u2").tobytes() + np.asarray(idx, "<u4").tobytes() + b"".join(vals)
    return head + body + pad, vol


def random_block(rng, grid, nlabels, max_sb_labels=6, zero_frac=0.1):
    """A random valid block with nsb in 0..max_sb_labels, and its expected volume."""
    labels = rng.integers(0, 2**64, size=nlabels, dtype=np.uint64)
    subs = []
    for _ in range(int(np.prod(grid))):
        if rng.random() < zero_frac:
            subs.append(([], None))
            continue
        n = int(rng.integers(1, min(max_sb_labels, nlabels) + 1))
        ix = rng.choice(nlabels, size=n, replace=False)
        v = rng.integers(0, n, size=512)
        v[:n] = np.arange(n)  # every listed label used
        subs.append((ix, rng.permutation(v)))
    return build_block(grid, labels, subs)


def ts_encode(vol_zyx: np.ndarray) -> bytes | None:
    """TensorStore's compressed_segmentation chunk of a (z, y, x) volume (None: not stored)."""
    import tensorstore as ts

    size = [int(s) for s in vol_zyx.shape[::-1]]
    t = ts.open({
        "driver": "neuroglancer_precomputed", "kvstore": {"driver": "memory"}, "create": True,
        "multiscale_metadata": {"type": "segmentation", "data_type": "uint64", "num_channels": 1},
        "scale_metadata": {"size": size, "resolution": [8, 8, 8], "chunk_size": size,
                           "encoding": "compressed_segmentation",
                           "compressed_segmentation_block_size": [8, 8, 8]},
    }).result()
    t[..., 0].write(vol_zyx.transpose(2, 1, 0)).result()
    r = t.kvstore.read(f"8_8_8/0-{size[0]}_0-{size[1]}_0-{size[2]}").result()
    return r.value if r.state == "value" else None


def ts_encode_chunks(origins, vols_zyx) -> list[bytes | None]:
    """`ts_encode` of many 64³ (z, y, x) volumes at their (x, y, z) voxel origins (multiples of 64),
    in one go: all written side by side into one unsharded in-memory volume, then its chunks read."""
    import tensorstore as ts

    origins = [np.asarray(o, np.int64) for o in origins]
    size = [int(v) + 64 for v in np.max(origins, axis=0)]
    t = ts.open({
        "driver": "neuroglancer_precomputed", "kvstore": {"driver": "memory"}, "create": True,
        "multiscale_metadata": {"type": "segmentation", "data_type": "uint64", "num_channels": 1},
        "scale_metadata": {"key": "k", "size": size, "resolution": [8, 8, 8], "chunk_size": [64, 64, 64],
                           "encoding": "compressed_segmentation", "compressed_segmentation_block_size": [8, 8, 8]},
    }).result()
    writes = [t[lo[0]:lo[0] + 64, lo[1]:lo[1] + 64, lo[2]:lo[2] + 64, 0].write(v.transpose(2, 1, 0))
              for lo, v in zip(origins, vols_zyx, strict=True)]
    for w in writes:
        w.result()
    reads = [t.kvstore.read("k/" + "_".join(f"{a}-{a + 64}" for a in lo.tolist())) for lo in origins]
    return [r.value if r.state == "value" else None for r in (f.result() for f in reads)]


def export_blocks(root) -> list[tuple[tuple[int, int, int], bytes]]:
    """Every DVID block the project's writer put in an export's scale 0, with its coordinate."""
    out = []
    for f in sorted((root / "s0").glob("*.arrow")):
        with pa.OSFile(str(f)) as src:
            for batch in pa.ipc.open_stream(src):
                d = batch.to_pydict()
                for i in range(batch.num_rows):
                    block = zstandard.ZstdDecompressor().decompress(d["dvid_compressed_block"][i])
                    out.append(((d["chunk_x"][i], d["chunk_y"][i], d["chunk_z"][i]), block))
    return out
