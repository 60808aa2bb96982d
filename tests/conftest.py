"""Shared fixtures: the real DVID files in ../shared/data/dvid and small helpers."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# the real data lives beside the project, never inside it
DVID_DATA = Path(os.environ.get("DVIDSHARDS_TEST_DATA", Path(__file__).resolve().parents[1].parent / "shared" / "data" / "dvid"))
REAL_SHARD = "30720_24576_28672"


def _require_real_data() -> Path:
    if (DVID_DATA / f"{REAL_SHARD}.arrow").is_file():
        return DVID_DATA
    msg = f"real DVID test data not found at {DVID_DATA} (expected ../shared/data/dvid beside the project)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(msg + "; under CI the real-data tests must run", pytrace=False)
    pytest.skip(msg)


# --- the two tiers ------------------------------------------------------------------------------
# `pytest -q -m "not slow"` (README) runs the default tier in a few minutes on 2 cores; `pytest -q -m
# slow` runs the rest, and .ci/run runs both. A slow test says so in its file (@pytest.mark.slow, or a
# module's pytestmark), so a renamed test keeps its tier. A test that starts a dask LocalCluster (the
# `client` fixture) belongs to the slow tier: collection fails if one is not marked.
SLOW_FIXTURES = {"client": "starts a dask LocalCluster"}


def pytest_configure(config):
    """With several xdist workers, compile every numba kernel once, up front (``dvidshards warm``),
    instead of each worker compiling the same ones side by side; tests of a cold cache make their
    own (empty) cache folders."""
    workers = getattr(config.option, "numprocesses", None)
    if hasattr(config, "workerinput") or not workers:
        return
    code = "from dvidshards.cli import main; raise SystemExit(main(['warm', '-j', '2']))"
    subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=1200, check=False)


def pytest_collection_modifyitems(config, items):
    """Hold the tiers to their rule: a test using a fixture of SLOW_FIXTURES must be marked slow."""
    unmarked = [f"{item.nodeid} ({why})" for item in items if not item.get_closest_marker("slow")
                for f, why in SLOW_FIXTURES.items() if f in getattr(item, "fixturenames", ())]
    if unmarked:
        raise pytest.UsageError("mark these tests @pytest.mark.slow: " + "; ".join(unmarked))


@pytest.fixture(scope="session")
def dvid_data() -> Path:
    """Folder holding the real DVID files; skips (or fails under CI=true) when absent."""
    return _require_real_data()


@pytest.fixture(scope="session")
def fib19_block(dvid_data) -> bytes:
    """DVID's own encoding of the fib19 sample1 volume (format §1)."""
    return gzip.decompress((dvid_data / "fib19-64x64x64-sample1-block.dat.gz").read_bytes())


@pytest.fixture(scope="session")
def fib19_volume(dvid_data) -> np.ndarray:
    """The fib19 sample1 ground truth, uint64 (z, y, x)."""
    raw = gzip.decompress((dvid_data / "fib19-64x64x64-sample1.dat.gz").read_bytes())
    return np.frombuffer(raw, dtype="<u8").reshape(64, 64, 64)


@pytest.fixture(scope="session")
def fib19_volume2(dvid_data) -> np.ndarray:
    """The fib19 sample2 volume, uint64 (z, y, x)."""
    raw = gzip.decompress((dvid_data / "fib19-64x64x64-sample2.dat.gz").read_bytes())
    return np.frombuffer(raw, dtype="<u8").reshape(64, 64, 64)


@pytest.fixture(scope="session")
def real_records(dvid_data) -> list[dict]:
    """Every record of the real mCNS shard as plain Python values (read with pyarrow, the reference)."""
    import pyarrow as pa
    import zstandard

    out = []
    with pa.OSFile(str(dvid_data / f"{REAL_SHARD}.arrow")) as f:
        for batch in pa.ipc.open_stream(f):
            d = batch.to_pydict()
            for i in range(batch.num_rows):
                rec = {k: d[k][i] for k in d}
                rec["block"] = zstandard.ZstdDecompressor().decompress(rec["dvid_compressed_block"])
                out.append(rec)
    return out


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


@pytest.fixture(scope="session")
def synthetic_export(tmp_path_factory) -> Export:
    """200x170x150 voxels, 2-chunk shards (several per axis), 3 scales, a mapping, variant A."""
    return make_export(tmp_path_factory.mktemp("export") / "exp")


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
