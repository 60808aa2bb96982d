"""Shared fixtures: the real DVID files in ../shared/data/dvid and small helpers."""

from __future__ import annotations

import gzip
import os
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
