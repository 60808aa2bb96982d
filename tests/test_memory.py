"""RSS stays flat over open/read/verify/drop cycles of clean and damaged exports, in one process.

The cycles run in a child process (``python -m tests.support.fuzz memory``) so that the
measurement starts from a clean interpreter and a crash is reported rather than fatal. Every
third cycle reads a clean export; the others take every mutation region of the fuzz harness in
turn (schema, batch headers, buffers, list offsets, labels, payload, end-of-stream, message
order, truncation, footers, CSV fields/rows/headers/text), on the synthetic exports and, when
../shared/data/dvid is present, on the real mCNS shard with its A, B and C indexes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dvidshards
from tests.support.data import DVID_DATA, REAL_SHARD

pytestmark = pytest.mark.slow  # memory soak: 150 open/read/verify cycles in a child process

CYCLES = 150
WARMUP = 30
LIMIT_MB = 100


def test_rss_flat_over_clean_and_damaged_cycles(tmp_path):
    log = tmp_path / "cycles.jsonl"
    cmd = [sys.executable, "-m", "tests.support.fuzz", "memory", "--workdir", str(tmp_path / "work"),
           "--cycles", str(CYCLES), "--warmup", str(WARMUP), "--seed", "3", "--log", str(log)]
    if (DVID_DATA / f"{REAL_SHARD}.arrow").is_file():
        cmd += ["--data", str(DVID_DATA)]
    env = dict(os.environ, PYTHONPATH=str(Path(dvidshards.__file__).resolve().parents[1]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    done = [json.loads(ln) for ln in log.read_text().splitlines()] if log.exists() else []
    assert proc.returncode == 0, (f"memory child exited with {proc.returncode} after {len(done)} cycles; "
                                  f"last: {done[-1:]}\n{proc.stderr[-3000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    rss = [v / 2**20 for v in res["rss"]]
    assert len(rss) == CYCLES
    labels = {d["label"].split(":")[0] for d in done}
    assert {"clean", "shard", "csv"} <= labels, labels  # clean and damaged exports were both cycled
    base = rss[WARMUP - 1]
    growth = max(rss[WARMUP:]) - base
    trace = " ".join(f"{v:.0f}" for v in rss[::10])
    assert growth <= LIMIT_MB, (f"RSS grew {growth:.0f} MB after warm-up (at cycle {WARMUP}: {base:.0f} MB; "
                                f"every 10th cycle: {trace}); process counts {res['counts']}")
    # what would make it grow over longer runs: maps of dropped shards, threads, open files
    warm, end = res["counts"]["warmup"], res["counts"]["end"]
    assert end["deleted_arrow_maps"] <= 2 and end["deleted_fds"] <= 2, res["counts"]
    assert end["os_threads"] - warm["os_threads"] <= 8 and end["fds"] - warm["fds"] <= 8, res["counts"]
