"""A bounded, seeded fuzz run: mutated shards and indexes give exact data or a typed error.

Every trial runs in a worker process (tests.support.fuzz.Campaign), so a crash or a hang
is counted against the trial that caused it. The full campaign is benchmarks/fuzz_shards.py.
"""

from __future__ import annotations

import pytest

from tests.support import fuzz

pytestmark = pytest.mark.slow  # fuzz campaigns over real and synthetic exports


def _run(workdir, templates, shard: int, csv: int, seed: int) -> fuzz.Campaign:
    camp = fuzz.Campaign(workdir, jobs=2, timeout=180, failures=workdir / "failures")
    camp.run(fuzz.plan_requests(templates, "shard", shard, seed) + fuzz.plan_requests(templates, "csv", csv, seed))
    return camp


def _assert_target(camp: fuzz.Campaign, min_regions: int) -> None:
    total = camp.counts()["total"]
    report = "\n".join([camp.table("shard"), "", camp.table("csv"), "", camp.rss_table(), ""] + [
        f"{e['as']} [{e['kind']}:{e['seed']}:{e['trial']}:{e['template']}] {e.get('mutation')} -> {e.get('detail')}"
        for e in camp.examples()])
    # the harness works: mutations were detected, some left the data intact, all regions were hit
    assert total["typed"] > 0 and total["exact"] > 0, report
    regions = {r["region"] for r in camp.results if "+" not in (r.get("region") or "+")}
    assert len(regions) >= min_regions, (sorted(regions), report)
    bad = {c: total[c] for c in fuzz.FAIL if total[c]}
    assert not bad, f"{bad} in {total['trials']} trials (inputs in {camp.failures})\n{report}"


def test_fuzz_synthetic_exports(tmp_path):
    """Writer-made exports of every index variant (A with 1 and 3 rows per batch, B, C, C file, D, no spec)."""
    templates = fuzz.build_templates(tmp_path, None, synthetic=True, real=False)
    camp = _run(tmp_path, templates, shard=100, csv=40, seed=1)
    _assert_target(camp, min_regions=14)


def test_fuzz_real_shard(tmp_path, dvid_data):
    """The real mCNS shard with its A, B and C indexes."""
    templates = fuzz.build_templates(tmp_path, dvid_data, synthetic=False, real=True)
    camp = _run(tmp_path, templates, shard=50, csv=20, seed=2)
    _assert_target(camp, min_regions=10)
