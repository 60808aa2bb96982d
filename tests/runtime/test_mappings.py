"""A mapping given as a file, in jobs: loaded once per worker process, never pickled into tasks;
a mapping that sends background to a body, from the reader's side."""

from __future__ import annotations

import functools
import pickle

import numpy as np
import pytest

import dvidshards
from dvidshards.errors import MappingError
from dvidshards.formats.labels import as_labels
from dvidshards.jobs.runner import TaskRunner, run_tasks
from dvidshards.runtime import mappings as mod


def _mapping_file(folder, n=50_000):
    rng = np.random.default_rng(5)
    sv = rng.choice(1 << 40, n, replace=False).astype(np.uint64) + np.uint64(1)
    body = sv // np.uint64(3) + np.uint64(1)
    p = folder / "mappings.txt"
    np.savetxt(p, np.stack([sv, body], 1), fmt="%d", delimiter=" ")
    return p, sv, body


def _task(labels, sv: np.ndarray, item: int) -> int:
    """A trivial task: apply the job's mapping to a palette; the checksum of the bodies."""
    part = sv[item % 97::97]
    with np.errstate(over="ignore"):
        return int(np.sum(labels.mapping.palette(part), dtype=np.uint64))


def _want(sv, body, item: int) -> int:
    with np.errstate(over="ignore"):
        return int(np.sum(body[item % 97::97], dtype=np.uint64))


def _info():
    return mod.cache_info()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DVIDSHARDS_CACHE_DIR", str(tmp_path / "cache"))  # spawned workers inherit it
    monkeypatch.setenv("DVIDSHARDS_MAPPING_SIDECAR_BYTES", "0")
    mod.clear_cache()
    yield tmp_path / "cache" / "mappings"
    mod.clear_cache()


def test_threads_share_one_load(tmp_path, cache):
    p, sv, body = _mapping_file(tmp_path)
    src = as_labels(str(p))
    rep = run_tasks(functools.partial(_task, src, sv), range(300), scheduler="threads:2", progress=False)
    assert rep.ok and rep.results == {i: _want(sv, body, i) for i in range(300)}
    info = mod.cache_info()  # parsed once (by a child process; then memory-mapped from its sidecar), shared
    assert info["parsed"] == 0 and info["built"] == 1 and info["hits"] <= 1  # one object: resolved once


@pytest.mark.slow
def test_dask_workers_load_a_mapping_file_once_each(tmp_path, cache):
    pytest.importorskip("distributed")
    p, sv, body = _mapping_file(tmp_path)
    src = as_labels(str(p))
    src.prepare()  # the client checks the file and builds the sidecar in a child process
    assert mod.cache_info()["parsed"] == 0 and mod.cache_info()["built"] == 1
    fn = functools.partial(_task, src, sv[:2000])
    assert len(pickle.dumps((fn, 7))) < 16_000 + 1000 < 16 * len(sv)  # the mapping is not in the task
    items = range(120)
    with TaskRunner("local:2", progress=False) as tr:
        rep = tr.run(fn, items)
        info = tr.client().run(_info)
        assert rep.ok, rep.summary()
        assert rep.results == {i: _want(sv[:2000], body[:2000], i) for i in items}
        assert len(info) == 2
        for w in info.values():  # each worker memory-mapped the sidecar once and parsed nothing
            assert w["parsed"] == w["built"] == 0 and w["opened"] == 1
        assert sum(w["hits"] for w in info.values()) == len(items) - 2
        p.write_text("1 2\n")  # the file changes after planning: every task fails, typed
        rep = tr.run(fn, range(4))
        assert not rep.results and set(rep.failed) == set(range(4))
        assert all(m.startswith("MappingError: ") and "changed after the job was planned" in m
                   for m in rep.failed.values())


def test_reading_with_a_mapping_of_0_to_a_body_is_a_mapping_error(tmp_path, synthetic_export):
    ex = synthetic_export
    p = tmp_path / "mappings.txt"
    rows = "".join(f"{a} {b}\n" for a, b in ex.mapping.tolist())
    p.write_text("sv body\n" + rows + "0 42\n")
    bad_line = 2 + len(ex.mapping)
    with pytest.raises(MappingError, match=rf"mappings.txt: line {bad_line} maps supervoxel 0 to body 42"):
        vol = dvidshards.open(ex.root, spec=ex.spec, labels=str(p))
        vol[:64, :64, :64].read().result()
    with pytest.raises(MappingError, match="maps supervoxel 0 to body 42"):
        dvidshards.Dataset(ex.root, spec=ex.spec).read([[0, 0, 0], [64, 64, 64]], labels={0: 42, 1: 2})
    p.write_text("sv body\n0 0\n" + rows)  # 0 -> 0 is fine
    got = dvidshards.Dataset(ex.root, spec=ex.spec).read([[0, 0, 0], [100, 90, 80]], labels=str(p))
    np.testing.assert_array_equal(got, ex.expected(0)[:100, :90, :80])
