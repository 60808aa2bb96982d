"""Shared fixtures and pytest hooks (the helpers they use are in tests/support/)."""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support import equal
from tests.support.data import REAL_SHARD, require_real_data
from tests.support.exports import THREE_SHARDS, Export, make_export

# np.testing.assert_array_equal without numpy's 4 ms of bookkeeping when the arrays are equal
# (failures are numpy's own): the suite compares thousands of 64³ chunks
equal.install()

# A suite started in the background by a script (`.ci/run &`, a busy-loop wrapper) inherits SIGINT
# ignored, and so would every command a test starts and then stops with Ctrl-C (it would never stop):
# Python's own Ctrl-C here makes the commands start with the default again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# --- the two tiers ------------------------------------------------------------------------------
# `pytest -q -m "not slow"` (README) runs the default tier in a few minutes on 2 cores; `pytest -q -m
# slow` runs the rest, and .ci/run runs both. A slow test says so in its file (@pytest.mark.slow, or a
# module's pytestmark), so a renamed test keeps its tier. A test that starts a dask LocalCluster (the
# `client` fixture) belongs to the slow tier: collection fails if one is not marked.
SLOW_FIXTURES = {"client": "starts a dask LocalCluster"}


def pytest_configure(config):
    """With several xdist workers, compile every numba kernel once, up front (``dvidshards warm -j 2``:
    40 s beside a busy loop on 2 cores, 50 s in one process), instead of each worker compiling the
    same ones side by side; tests of a cold cache make their own (empty) cache folders.

    The suite starts about a hundred Python processes (workers, commands, servers, spawned job
    workers), each importing the package and the test helpers: with PYTHONDONTWRITEBYTECODE set in
    the environment every one of them compiled them again (and each worker rewrote every test
    module's asserts: 10.5 s of collection against 4.3 s), so the suite writes its bytecode."""
    if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
        sys.dont_write_bytecode = False
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
    return require_real_data()


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


@pytest.fixture(scope="session")
def synthetic_export(tmp_path_factory) -> Export:
    """200x170x150 voxels, 2-chunk shards (several per axis), 3 scales, a mapping, variant A."""
    return make_export(tmp_path_factory.mktemp("export") / "exp")


@pytest.fixture(scope="session")
def three_shards(tmp_path_factory) -> Export:
    """300x100x70 voxels (THREE_SHARDS): shards of 128 voxels at x = 0, 128, 256, 2 scales, a mapping,
    variant A with one record per batch. Tests copy it (support.exports.copy_export) before changing it."""
    return make_export(tmp_path_factory.mktemp("three") / "exp", THREE_SHARDS, seed=5, scales=2, shard_chunks=2)


@pytest.fixture(scope="module")
def real_export(dvid_data, tmp_path_factory):
    """The real mCNS shard as the one file of an export holding only scale 1 (links, not copies),
    with the real multiscale spec: ``(root, spec)``."""
    import json

    root = tmp_path_factory.mktemp("real") / "exp"
    (root / "s1").mkdir(parents=True)
    (root / "s1" / f"{REAL_SHARD}.arrow").symlink_to(dvid_data / f"{REAL_SHARD}.arrow")
    (root / "s1" / f"{REAL_SHARD}.csv").symlink_to(dvid_data / f"{REAL_SHARD}-newformat.csv")
    return root, json.loads((dvid_data / "mcns-ng-specs.json").read_text())
