"""Synthetic exports written by the project's writer, with the volumes they were made from, and
small helpers over them (copy, read a box, the records of a shard, consolidate)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from tests.support.waiting import HANG_SECONDS


class Export:
    """A synthetic export written by the project's writer, with the volumes it was made from."""

    def __init__(self, root, spec, sv, mapping, scales):
        self.root, self.spec, self.sv, self.mapping, self.scales = root, spec, sv, mapping, scales

    def expected(self, scale: int, labels="agglomerated") -> np.ndarray:
        """The x,y,z volume a reader must return at a scale."""
        sv = self.scales[scale]
        if isinstance(labels, str) and labels == "supervoxels":
            return sv
        from dvidshards.formats.mapping import LabelMapping

        m = self.mapping if isinstance(labels, str) else labels
        return LabelMapping.from_any(m)(sv)


def downsample_mode(vol: np.ndarray, k: int) -> list[np.ndarray]:
    """Scales 0..k-1 of a volume by TensorStore's 2x mode downsampling (what the writer uses)."""
    import tensorstore as ts

    out = [vol]
    for _ in range(k - 1):
        out.append(ts.downsample(ts.array(out[-1]), [2, 2, 2], "mode").read().result())
    return out


def make_export(root, shape=(200, 170, 150), *, seed=3, scales=3, **kw) -> Export:
    from dvidshards.demo.neurons import neuron_volume
    from dvidshards.writer import write_export

    sv, mapping = neuron_volume(shape, n_bodies=10, svs_per_body=4, seed=seed)
    kw.setdefault("shard_chunks", 2)
    spec = write_export(sv, root, mapping=mapping, scales=scales, **kw)
    return Export(str(root), spec, sv, mapping, downsample_mode(sv, scales))


def load_shard(root, stem: str, *, extent: int | None = None, policy=None, store=None, index=None):
    """Load one shard by its stem (``"s1/30720_24576_28672"``) through the library's one loader.

    ``extent`` is the shard size in voxels (default: one shard holds every chunk).
    """
    from dvidshards.formats.multiscale import SINGLE_SHARD, Scale
    from dvidshards.shard import load_shard_sync
    from dvidshards.stores import LocalStore

    folder, name = stem.split("/")
    origin = tuple(int(v) for v in name.split("_"))
    scale = Scale(int(folder[1:]), (1 << 30,) * 3, None, extent or SINGLE_SHARD)
    return load_shard_sync(store or LocalStore(root), scale, origin, policy=policy, index=index)


# --- a three-shard export and what tests do to a copy of it ----------------------------------------

THREE_SHARDS = (300, 100, 70)  # shards of 128 voxels (2 chunks of 64) at x = 0, 128, 256


def copy_export(ex: Export, tmp_path, name: str = "exp") -> Path:
    """A copy of an export's files to change (the fixture's own files stay clean)."""
    dst = Path(tmp_path) / name
    shutil.copytree(ex.root, dst)
    return dst


def crop(ex: Export, box, scale: int = 0, labels="agglomerated") -> np.ndarray:
    """What a read of ``box`` ([[x0, y0, z0], [x1, y1, z1]]) must return."""
    (x0, y0, z0), (x1, y1, z1) = box
    sv = ex.scales[scale][x0:x1, y0:y1, z0:z1]
    if isinstance(labels, str) and labels == "supervoxels":
        return sv
    from dvidshards.formats.mapping import LabelMapping

    return LabelMapping.from_any(ex.mapping if isinstance(labels, str) else labels)(sv)  # voxel by voxel: the box only


def ts_read(vol, box) -> np.ndarray:
    """``box`` of a TensorStore volume, x,y,z (Fortran) order."""
    (x0, y0, z0), (x1, y1, z1) = box
    return vol[x0:x1, y0:y1, z0:z1].read(order="F").result(timeout=HANG_SECONDS)


def shard_records(arrow: bytes) -> list[dict]:
    """Every record of a shard file's bytes as plain Python values (read with pyarrow)."""
    import pyarrow as pa

    out = []
    for batch in pa.ipc.open_stream(pa.py_buffer(arrow)):
        d = batch.to_pydict()
        out += [{k: d[k][i] for k in d} for i in range(batch.num_rows)]
    return out


def consolidate(root, out, spec=None):
    """Write the consolidated index of every scale of an export into ``out``."""
    from dvidshards import Dataset
    from dvidshards.consolidated import write_consolidated

    ds = Dataset(root, spec=spec)
    for s in ds.scales:
        write_consolidated(ds, s, str(out))
    return out


def spec_file(ex: Export, folder) -> str:
    """The export's spec written as ``folder/spec.json`` (for the command line's --spec)."""
    p = Path(folder) / "spec.json"
    p.write_text(json.dumps(ex.spec))
    return str(p)
