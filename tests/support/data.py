"""Where the real DVID files are (../shared/data/dvid beside the project, never inside it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

DVID_DATA = Path(os.environ.get("DVIDSHARDS_TEST_DATA", Path(__file__).resolve().parents[2].parent / "shared" / "data" / "dvid"))
REAL_SHARD = "30720_24576_28672"


def require_real_data() -> Path:
    """The folder of real DVID files; skips the test when it is absent (fails under CI=true)."""
    if (DVID_DATA / f"{REAL_SHARD}.arrow").is_file():
        return DVID_DATA
    msg = f"real DVID test data not found at {DVID_DATA} (expected ../shared/data/dvid beside the project)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(msg + "; under CI the real-data tests must run", pytrace=False)
    pytest.skip(msg)
