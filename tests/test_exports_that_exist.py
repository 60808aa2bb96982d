"""The exports that exist, tried from the user's side.

* DVID named shard files one cube per scale before 2026-03-21 (the real mCNS export): with the
  real spec, scales 7-9 are two files where neuroglancer has one shard. Built here procedurally
  with the real spec's s7-s9 geometry (`write_export(..., naming="old", zero_blocks=True)`: old
  exports also keep all-background blocks), then read in both label modes, by TensorStore and the
  bulk reader, through ``info``, ``verify``, ``consolidate``, body queries and Flight.
* DVID exports scale 0 only by default: the real mCNS shard as an s0-only export with the
  12-scale spec.
* A downsample destination read over its source as one pyramid (a root list, or its manifest).
* Without a spec, one GeometryWarning per Dataset, at the caller's line.
"""

from __future__ import annotations

import json
import pickle
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts

import dvidshards
from dvidshards import Dataset, GeometryWarning, SpecError, write_export
from dvidshards.cli import main as cli
from dvidshards.dataset import IncompleteScalesWarning, LayeredStore
from dvidshards.errors import NotExportedError
from dvidshards.formats.codec import decode_block
from dvidshards.jobs.convert import convert
from dvidshards.stores import MemoryStore
from tests.support.data import REAL_SHARD
from tests.support.exports import make_export

OLD_SCALES = (7, 8, 9)


# --------------------------------------------------------------------------- procedural content


def _sv(x, y, z) -> np.ndarray:
    """Supervoxel ids of voxels: 24-voxel cells, 50 ids (never 0)."""
    return (1 + (x // 24 + 7 * (y // 24) + 31 * (z // 24)) % 50).astype(np.uint64)


MAPPING = {s: (0 if s % 13 == 0 else 100 + s % 7) for s in range(1, 51)}  # a few supervoxels map to body 0


def _boxes(size) -> list[tuple[np.ndarray, np.ndarray]]:
    """Where a scale holds data: a block across the old files' boundary near the far z end, and a
    column at the far x, y corner (the rest is background)."""
    x, y, z = size
    return [(np.array([0, 0, max(0, z - 150)]), np.array([min(x, 150), min(y, 120), z])),
            (np.array([max(0, x - 70), max(0, y - 70), 0]), np.array([x, y, z]))]


def _truth(size, box, labels="supervoxels", out=None) -> np.ndarray:
    """The (x, y, z) voxels of a box, from the generator (the independent reference)."""
    lo, hi = (np.asarray(v, np.int64) for v in box)
    if out is None:
        out = np.zeros(hi - lo, np.uint64)
    else:
        out[...] = 0
    for blo, bhi in _boxes(size):
        a, b = np.maximum(lo, blo), np.minimum(hi, bhi)
        if (a < b).all():
            x, y, z = np.meshgrid(*(np.arange(a[i], b[i]) for i in range(3)), indexing="ij")
            out[tuple(slice(a[i] - lo[i], b[i] - lo[i]) for i in range(3))] = _sv(x, y, z)
    if labels == "agglomerated":
        lut = np.zeros(51, np.uint64)
        for s, b in MAPPING.items():
            lut[s] = b
        out = lut[out]
    return out


def _volume(size) -> ts.TensorStore:
    """The content of a scale as a lazy TensorStore (nothing of the mostly empty volume is held)."""
    def read(domain, array, params):
        _truth(size, (domain.inclusive_min, domain.exclusive_max), out=array)

    return ts.virtual_chunked(read, dtype=ts.uint8, domain=ts.IndexDomain(shape=list(size)),  # ids <= 50
                              chunk_layout=ts.ChunkLayout(read_chunk_shape=[64, 64, 64]))


def write_scales(spec: dict, root: Path, scales, *, naming: str, zero_blocks: bool = False, work: Path) -> None:
    """Folders ``s{k}`` of ``root`` as DVID would have written them with ``spec``, each scale from its
    own procedural content (write_export writes one scale with that scale's sharding, then the folder
    is renamed)."""
    root.mkdir(parents=True, exist_ok=True)
    for k in scales:
        sc = spec["scales"][k]
        tmp = work / f"w{k}"
        write_export(_volume(sc["size"]), tmp, mapping=MAPPING, sharding=sc["sharding"], batch_size=256,
                     naming=naming, zero_blocks=zero_blocks, progress=False)
        (tmp / "s0").rename(root / f"s{k}")
        shutil.rmtree(tmp)


@pytest.fixture(scope="module")
def mcns_spec(dvid_data) -> dict:
    return json.loads((dvid_data / "mcns-ng-specs.json").read_text())


@pytest.fixture(scope="module")
def spec_path(dvid_data) -> str:
    return str(dvid_data / "mcns-ng-specs.json")


@pytest.fixture(scope="module")
def old_mcns(mcns_spec, tmp_path_factory) -> Path:
    """s7-s9 of the real spec, named as DVID did before 2026-03-21, all-background blocks kept."""
    base = Path(tmp_path_factory.mktemp("old_mcns"))
    write_scales(mcns_spec, base / "exp", OLD_SCALES, naming="old", zero_blocks=True, work=base)
    return base / "exp"


# --------------------------------------------------------------------------- the old names


def test_old_names_at_s7_s9_are_two_files_per_scale(old_mcns):
    """As in the real mCNS export: 0_0_0 and 0_0_{1024, 512, 256} where neuroglancer has one shard."""
    for k, e in zip(OLD_SCALES, (1024, 512, 256), strict=True):
        assert sorted(p.name for p in (old_mcns / f"s{k}").glob("*.arrow")) == ["0_0_0.arrow", f"0_0_{e}.arrow"]


def test_old_names_read_exactly_in_both_label_modes(old_mcns, mcns_spec):
    ds = Dataset(old_mcns, spec=mcns_spec)
    assert [(s.index, s.naming, s.shard_extent) for s in ds.scales if s.index in OLD_SCALES] == \
        [(7, "old", 1024), (8, "old", 512), (9, "old", 256)]
    assert all(s.naming == "current" for s in ds.scales if s.index not in OLD_SCALES)
    assert ds.exported == OLD_SCALES
    for k in OLD_SCALES:
        size = ds.scale(k).size
        z = size[2]
        cross = [[0, 0, z - 150], [150, 120, z]]  # across the boundary of the two files
        corner = [[size[0] - 90, size[1] - 90, z - 200], list(size)]  # the column, across the boundary too
        for labels in ("agglomerated", "supervoxels"):
            for box in (cross, corner):
                want = _truth(size, box, labels)
                assert want.any()
                np.testing.assert_array_equal(ds.read(box, scale=k, labels=labels), want)  # the bulk reader
                vol = ds.open(k, labels=labels)  # TensorStore
                got = vol[box[0][0]:box[1][0], box[0][1]:box[1][1], box[0][2]:box[1][2]].read(order="F").result()
                np.testing.assert_array_equal(got, want)
    # the whole of s9, through dvidshards.open, every chunk (the all-zero ones are records here)
    s9 = ds.scale(9)
    got = dvidshards.open(old_mcns, spec=mcns_spec, scale=9, labels="supervoxels").read(order="F").result()
    np.testing.assert_array_equal(got, _truth(s9.size, [[0, 0, 0], list(s9.size)]))


def test_old_names_shards_chunks_and_body_queries(old_mcns, mcns_spec):
    ds = Dataset(old_mcns, spec=mcns_spec)
    assert ds.shards(7) == [(0, 0, 0), (0, 0, 1024)]
    s8 = ds.scale(8)
    grid = {tuple(c) for c in np.argwhere(np.ones(s8.grid, bool))}
    assert {tuple(int(v) for v in c) for c in ds.chunks(8)} == grid  # old exports keep all-zero blocks
    s9 = ds.scale(9)
    whole = [[0, 0, 0], list(s9.size)]
    truth = _truth(s9.size, whole, "agglomerated")
    ids, counts = np.unique(truth[truth > 0], return_counts=True)
    for body, n in zip(ids.tolist(), counts.tolist(), strict=True):
        b = ds.body(body, scale=9)
        assert b.size() == n
        where = np.argwhere(truth == body)
        assert b.box() == [where.min(axis=0).tolist(), (where.max(axis=0) + 1).tolist()]
    np.testing.assert_array_equal(ds.labels(whole, scale=9), np.unique(truth))  # background (0) included
    sv = _truth(s9.size, whole)
    chunks = {tuple(int(v) // 64 for v in p) for p in np.argwhere(sv == 7)}
    assert {tuple(int(v) for v in c) for c in ds.chunks_with([7], scale=9, labels="supervoxels")} == chunks


def test_old_names_info_verify_consolidate_from_the_command_line(old_mcns, spec_path, tmp_path, capsys):
    assert cli(["info", str(old_mcns), "--spec", spec_path]) == 0
    out = capsys.readouterr().out
    rows = {int(r.split()[0]): r.split() for r in out.splitlines() if r.strip()[:1].isdigit() and "x" in r}
    head = next(r.split() for r in out.splitlines() if r.startswith("scale"))
    col = head.index("naming") - 1  # "size (x,y,z)" is two header words
    assert [rows[k][col] for k in OLD_SCALES] == ["old"] * 3
    assert [rows[k][col - 1] for k in OLD_SCALES] == ["1024", "512", "256"]
    assert "not exported: s0-s6, s10, s11" in out and "before 2026-03-21" in out
    assert cli(["verify", str(old_mcns), "--spec", spec_path, "--decode", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "6 shards" in out and "no problems" in out and "not exported: s0-s6, s10, s11" in out
    idx = tmp_path / "idx"
    assert cli(["consolidate", str(old_mcns), "--spec", spec_path, "--out", str(idx), "--quiet"]) == 0
    assert sorted(p.name for p in idx.glob("*.chunks.arrow")) == [f"s{k}.chunks.arrow" for k in OLD_SCALES]
    ds = Dataset(old_mcns, spec=spec_path, index=idx)  # the naming read from the index's shard list
    assert [ds.scale(k).naming for k in OLD_SCALES] == ["old"] * 3
    from dvidshards.consolidated import ConsolidatedIndex

    assert [ConsolidatedIndex(str(idx), f"s{k}").meta["naming"] for k in OLD_SCALES] == ["old"] * 3
    s8 = ds.scale(8)
    box = [[0, 0, 376], [150, 120, 526]]
    np.testing.assert_array_equal(ds.read(box, scale=8), _truth(s8.size, box, "agglomerated"))


def test_a_file_that_fits_neither_naming_is_the_spec_error_naming_both(old_mcns, mcns_spec, spec_path, tmp_path,
                                                                      capsys):
    root = tmp_path / "exp"
    shutil.copytree(old_mcns, root)
    for ext in ("arrow", "csv"):  # 0_0_128: on neither the 256 nor the 320 grid of s9
        shutil.copy(root / "s9" / f"0_0_256.{ext}", root / "s9" / f"0_0_128.{ext}")
    ds = Dataset(root, spec=mcns_spec)
    with pytest.raises(SpecError, match=r"s9/0_0_128.arrow: this shard file is not on the shard grid") as e:
        ds.read([[0, 0, 0], [64, 64, 64]], scale=9)
    assert "256 voxels" in str(e.value) and "320 voxels" in str(e.value) and "\n" not in str(e.value)
    assert cli(["info", str(root), "--spec", spec_path]) == 2
    assert "0_0_128.arrow" in capsys.readouterr().err
    # scales 7 and 8 are unaffected
    s8 = ds.scale(8)
    np.testing.assert_array_equal(ds.read([[0, 0, 376], [150, 120, 526]], scale=8),
                                  _truth(s8.size, [[0, 0, 376], [150, 120, 526]], "agglomerated"))


def test_old_names_over_flight_read_as_today_s_shards(old_mcns, mcns_spec):
    """A Flight client names shards from the spec, as DVID does today: the server regroups the old files."""
    from dvidshards.serve.flight import serve
    from dvidshards.sources.flight import FlightSource

    ds = Dataset(old_mcns, spec=mcns_spec)
    with serve(str(old_mcns), spec=mcns_spec) as srv:
        client = Dataset(FlightSource(srv.location))
        assert client.shards(7) == [(0, 0, 0)]  # one shard of 1088 voxels, as neuroglancer has it
        for k in OLD_SCALES:
            size = ds.scale(k).size
            box = [[0, 0, size[2] - 150], [150, 120, size[2]]]
            np.testing.assert_array_equal(client.read(box, scale=k), _truth(size, box, "agglomerated"))


class _Counting(MemoryStore):
    """A memory store that counts the folders it is asked to list, and can pretend to be remote."""

    def __init__(self, files, immediate=True):
        super().__init__(files, name="counting")
        self.immediate = immediate
        self.listed: list[str] = []

    async def list(self, prefix=""):
        self.listed.append(prefix)
        return await super().list(prefix)

    async def sample(self, prefix, n):
        if not self.immediate:
            return None  # an object store gives no cheap sample
        self.listed.append(prefix)
        return [k for k in await MemoryStore.list(self, prefix) if k.endswith(".arrow")][:n]


def _files(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("immediate", [True, False], ids=["local", "remote"])
def test_naming_detection_lists_only_the_scales_where_the_namings_differ(old_mcns, mcns_spec, immediate):
    st = _Counting(_files(old_mcns), immediate)
    ds = Dataset(st, spec=mcns_spec)
    # never s0 (26 K files at mCNS) nor the root (a local export's scale folders are found by a stat each)
    assert sorted(st.listed) == [f"s{k}" for k in (10, 11, 7, 8, 9)]
    assert [ds.scale(k).naming for k in OLD_SCALES] == ["old"] * 3
    st.listed.clear()
    if immediate:
        assert ds.exported == OLD_SCALES and st.listed == []  # an attribute: nothing read
    else:  # an object store: the listings at open said it all (s9 is there, s10 and s11 are not), and
        # an export holds a prefix of its spec's scales (FORMATS.md §3a): s0-s9, without listing s0-s6
        assert ds.exported == tuple(range(10)) and st.listed == []
    s9 = ds.scale(9)
    np.testing.assert_array_equal(ds.read([[0, 0, 0], list(s9.size)], scale=9), _truth(s9.size, [[0, 0, 0], list(s9.size)],
                                                                                  "agglomerated"))


# --------------------------------------------------------------------------- partial exports


@pytest.fixture(scope="module")
def s0_only_real(dvid_data, tmp_path_factory) -> Path:
    """The real mCNS shard as the one file of an s0-only export (DVID's default since 2026-03-29)."""
    root = Path(tmp_path_factory.mktemp("s0_only")) / "exp"
    (root / "s0").mkdir(parents=True)
    shutil.copy(dvid_data / f"{REAL_SHARD}.arrow", root / "s0" / f"{REAL_SHARD}.arrow")
    shutil.copy(dvid_data / f"{REAL_SHARD}-newformat.csv", root / "s0" / f"{REAL_SHARD}.csv")
    return root


def test_s0_only_export_with_the_12_scale_spec(s0_only_real, mcns_spec, spec_path, real_records, capsys):
    ds = Dataset(s0_only_real, spec=mcns_spec)
    assert ds.exported == (0,) and len(ds.scales) == 12
    # reads of s0 exact: every record's block decoded with its own palettes (pyarrow-read, the reference)
    for rec in real_records[::17]:
        c = np.array([rec["chunk_x"], rec["chunk_y"], rec["chunk_z"]]) * 64
        box = [c.tolist(), (c + 64).tolist()]
        sv = decode_block(rec["block"], np.asarray(rec["supervoxels"], np.uint64))  # (z, y, x)
        agg = decode_block(rec["block"], np.asarray(rec["labels"], np.uint64))
        np.testing.assert_array_equal(ds.read(box, scale=0, labels="supervoxels"), sv.T)
        np.testing.assert_array_equal(ds.read(box, scale=0), agg.T)
    # scale 1: one line naming it, what the export holds and how to make it
    for call in (lambda: ds.read([[0, 0, 0], [64, 64, 64]], scale=1), lambda: ds.open(1), lambda: ds.shards(1),
                 lambda: ds.require_scale(1), lambda: dvidshards.open(s0_only_real, spec=mcns_spec, scale=1),
                 lambda: ds.chunks(2), lambda: ds.body(1, scale=3).size()):
        with pytest.raises(NotExportedError) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and "it holds s0" in msg and f"dvidshards downsample {s0_only_real} DEST" in msg, msg
        assert isinstance(e.value, SpecError)
    assert ds.require_scale(0) is ds.scale(0)
    assert str(pytest.raises(NotExportedError, ds.require_scale, 2).value) == (
        f"scale 2 is not exported in {s0_only_real} (it has no folder s2; it holds s0); make it with: dvidshards "
        f"downsample {s0_only_real} DEST")
    # info: exit 0, every other scale "not exported", a line under the table
    assert cli(["info", str(s0_only_real), "--spec", spec_path]) == 0
    out = capsys.readouterr().out
    rows = [r for r in out.splitlines() if r.strip()[:1].isdigit() and "x" in r]
    assert [r.split()[0] for r in rows if "not exported" in r] == [str(k) for k in range(1, 12)]
    assert "258" in rows[0].split() and "either" in rows[0].split()
    assert f"not exported: s1-s11 (the spec lists them, this export does not hold them; make them with: " \
           f"dvidshards downsample {s0_only_real} DEST)" in out
    # verify agrees with info: exit 0, the same line, no SpecError doubting the spec
    assert cli(["verify", str(s0_only_real), "--spec", spec_path, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "no problems" in out and "not exported: s1-s11" in out and "SpecError" not in out
    assert cli(["verify", str(s0_only_real), "--spec", spec_path, "--scale", "3", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "scale 3 is not exported" in err and len(err.strip().splitlines()) == 1


def test_partial_export_with_its_own_spec(tmp_path, capsys):
    """write_export(only_scales=[0, 1]) of a 3-scale spec: jobs work on the scales present."""
    exp = make_export(tmp_path / "exp", (130, 100, 70), seed=4, scales=3, only_scales=[0, 1], info=True)
    assert sorted(p.name for p in Path(exp.root).iterdir()) == ["info", "s0", "s1"]
    ds = Dataset(exp.root)  # geometry from the info file, which lists three scales
    assert ds.exported == (0, 1) and [s.index for s in ds.scales] == [0, 1, 2]
    for k in (0, 1):
        np.testing.assert_array_equal(ds.read([[0, 0, 0], list(ds.scale(k).size)], scale=k), exp.expected(k))
    with pytest.raises(NotExportedError, match="scale 2 is not exported"):
        ds.read([[0, 0, 0], [8, 8, 8]], scale=2)
    assert not ds.read([[0, 0, 0], [8, 8, 8]], scale=2, fill_missing_shards=True).any()  # asked for: background
    idx = tmp_path / "idx"
    assert cli(["consolidate", exp.root, "--out", str(idx), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.count("chunks in") == 2 and "not exported: s2" in out
    assert cli(["consolidate", exp.root, "--out", str(tmp_path / "i2"), "--scale", "2", "--quiet"]) == 2
    assert "scale 2 is not exported" in capsys.readouterr().err and not (tmp_path / "i2").exists()
    report = dvidshards.verify(exp.root)
    assert report.ok and report.not_exported == [2]


# --------------------------------------------------------------------------- a source and a downsample destination


@pytest.fixture(scope="module")
def pyramid(tmp_path_factory):
    """A 3-scale export written whole (the reference), and the same as an s0-only source plus a
    destination holding s1, s2 (as ``dvidshards downsample`` writes it: info file, manifest)."""
    base = Path(tmp_path_factory.mktemp("pyramid"))
    whole = make_export(base / "whole", (200, 170, 150), seed=6, scales=3)
    write_export(whole.sv, base / "src", mapping=whole.mapping, scales=3, shard_chunks=2, only_scales=[0])
    write_export(whole.sv, base / "dest", mapping=whole.mapping, scales=3, shard_chunks=2, only_scales=[1, 2],
                 info=True)
    manifest = {"dvidshards": {"manifest": 1}, "job": "downsample", "source": {"url": str(base / "src")},
                "scales": [1, 2], "complete": True, "status": "complete"}
    (base / "dest" / "_dvidshards.json").write_text(json.dumps(manifest))
    return whole, base / "src", base / "dest"


def _same_pyramid(ds: Dataset, whole) -> None:
    assert ds.exported == (0, 1, 2)
    for k in range(3):
        for labels in ("agglomerated", "supervoxels"):
            np.testing.assert_array_equal(ds.read([[0, 0, 0], list(ds.scale(k).size)], scale=k, labels=labels,
                                                  fill_missing_shards=True),
                                          whole.expected(k, labels))
        vol = dvidshards.open(ds, scale=k, fill_missing_shards=True)
        np.testing.assert_array_equal(vol.read(order="F").result(), whole.expected(k))


def test_a_root_list_is_one_pyramid(pyramid):
    whole, src, dest = pyramid
    ds = Dataset([src, dest], spec=whole.spec)
    assert isinstance(ds.store, LayeredStore) and ds.store.route == {0: 0, 1: 1, 2: 1}
    _same_pyramid(ds, whole)
    assert ds.shards(1) == Dataset(whole.root, spec=whole.spec).shards(1)
    assert ds.store.describe("s1/0_0_0.arrow") == f"{dest}/s1/0_0_0.arrow"  # messages name the real file
    vol = dvidshards.open([str(src), str(dest)], spec=whole.spec, scale=2, labels="supervoxels")
    np.testing.assert_array_equal(vol.read(order="F").result(), whole.expected(2, "supervoxels"))
    again = pickle.loads(pickle.dumps(ds))  # what a job's workers get
    np.testing.assert_array_equal(again.read([[0, 0, 0], list(ds.scale(1).size)], scale=1), whole.expected(1))
    reader = pickle.loads(pickle.dumps(ds.reader(2)))
    assert reader.store == ds.store


def test_a_root_list_without_a_manifest_takes_each_scale_from_the_first_root_holding_it(pyramid, tmp_path):
    whole, src, dest = pyramid
    plain = tmp_path / "coarse"
    shutil.copytree(dest, plain, ignore=shutil.ignore_patterns("_dvidshards.json"))
    ds = Dataset([plain, src], spec=whole.spec)  # in this order: s1, s2 from the first, s0 from the second
    assert ds.store.route == {0: 1, 1: 0, 2: 0} and ds.exported == (0, 1, 2)
    _same_pyramid(ds, whole)
    ds = Dataset([src, whole.root], spec=whole.spec)  # s0 from src, s1 and s2 from the whole export
    assert ds.store.route == {0: 0, 1: 1, 2: 1}
    _same_pyramid(ds, whole)


def test_a_downsample_destination_opens_over_its_source(pyramid, capsys):
    whole, src, dest = pyramid
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # complete: no warning; geometry from dest's info file
        ds = Dataset(dest)
    assert ds.spec is not None and [s.index for s in ds.scales] == [0, 1, 2]
    _same_pyramid(ds, whole)
    again = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(again.read([[0, 0, 0], list(ds.scale(2).size)], scale=2), whole.expected(2))
    assert cli(["info", str(dest)]) == 0
    out = capsys.readouterr().out
    assert f"  s0 from {src}" in out and f"  s1, s2 from {dest}" in out and "not exported" not in out
    assert cli(["verify", str(dest), "--quiet"]) == 0
    assert "no problems" in capsys.readouterr().out


def test_an_incomplete_destination_warns_once(pyramid, tmp_path):
    whole, src, dest = pyramid
    d2 = tmp_path / "dest"
    shutil.copytree(dest, d2)
    m = json.loads((d2 / "_dvidshards.json").read_text())
    (d2 / "_dvidshards.json").write_text(json.dumps({**m, "complete": False, "status": "interrupted"}))
    with pytest.warns(IncompleteScalesWarning, match="s1, s2 are not complete") as rec:
        ds = Dataset(d2)
    assert len(rec) == 1 and rec[0].filename == __file__
    np.testing.assert_array_equal(ds.read([[0, 0, 0], list(ds.scale(1).size)], scale=1), whole.expected(1))
    (d2 / "_dvidshards.json").write_text(json.dumps({**m, "source": "nowhere"}))
    with pytest.raises(SpecError, match="_dvidshards.json: a downsample manifest needs source.url"):
        Dataset(d2)


# --------------------------------------------------------------------------- no spec: one warning, at the caller


def test_no_spec_warns_once_at_the_caller(synthetic_export, capsys):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ds = Dataset(synthetic_export.root)
        ds.read([[0, 0, 0], [64, 64, 64]], scale=0)
        ds.read([[0, 0, 0], [32, 32, 32]], scale=2)
        ds.shards(1)
    geometry = [w for w in rec if issubclass(w.category, GeometryWarning)]
    assert len(geometry) == 1 and geometry[0].filename == __file__, [(w.filename, str(w.message)) for w in rec]
    assert "s1" not in str(geometry[0].message) and "s2" not in str(geometry[0].message)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        dvidshards.open(synthetic_export.root, scale=1)
    assert len(rec) == 1 and rec[0].filename == __file__
    # a command: one warning line, whatever the number of scale folders
    assert cli(["verify", synthetic_export.root, "--quiet"]) == 0
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "GeometryWarning" not in err


# --------------------------------------------------------------------------- on an object store


def test_old_names_and_an_s0_only_export_on_s3(old_mcns, s0_only_real, mcns_spec, real_records):
    """An object store lists only the coarse scales where the namings differ (never s0) and reads exactly."""
    pytest.importorskip("moto.server")
    from tests.support.servers import MotoS3

    ctx = MotoS3().start()
    try:
        for prefix, root in (("old/", old_mcns), ("s0only/", s0_only_real)):
            for k, v in _files(root).items():
                ctx.upload("exports", prefix + k, v)
        ds = Dataset(ctx.spec("exports", "old/"), spec=mcns_spec)
        assert [ds.scale(k).naming for k in OLD_SCALES] == ["old"] * 3
        for k in OLD_SCALES:
            size = ds.scale(k).size
            box = [[0, 0, size[2] - 150], [150, 120, size[2]]]
            np.testing.assert_array_equal(ds.read(box, scale=k, labels="supervoxels"), _truth(size, box))
        ds = Dataset(ctx.spec("exports", "s0only/"), spec=mcns_spec)
        assert ds.exported == (0,)  # s1-s11 listed (each one request, nothing there); s0 never listed
        rec = real_records[5]
        c = np.array([rec["chunk_x"], rec["chunk_y"], rec["chunk_z"]]) * 64
        np.testing.assert_array_equal(ds.read([c.tolist(), (c + 64).tolist()]),
                                      decode_block(rec["block"], np.asarray(rec["labels"], np.uint64)).T)
        with pytest.raises(NotExportedError, match="scale 1 is not exported in s3://exports/s0only"):
            ds.open(1)
    finally:
        ctx.stop()


# --------------------------------------------------------------------------- convert


def _precomputed(dest, key) -> ts.TensorStore:
    """A converted scale through TensorStore's own driver (x, y, z), never through dvidshards."""
    return ts.open({"driver": "neuroglancer_precomputed", "kvstore": f"file://{dest}/",
                    "scale_metadata": {"key": key}}).result()[..., 0]


def test_convert_old_names_at_s8_s9_reads_back_by_tensorstore(old_mcns, mcns_spec, spec_path, tmp_path, capsys):
    """`convert --scales 8 9` of the old names with the real spec: each output shard (one per scale:
    the spec has 0 shard bits there) made by one task from the two files meeting it."""
    dest = tmp_path / "out"
    assert cli(["convert", str(old_mcns), str(dest), "--format", "precomputed", "--spec", spec_path, "--scales", "8",
                "9", "--scheduler", "serial", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "complete: 2 of 2 tasks" in out, out
    info = json.loads((dest / "info").read_text())
    assert [s["key"] for s in info["scales"]] == [mcns_spec["scales"][k]["key"] for k in (8, 9)]
    ds = Dataset(old_mcns, spec=mcns_spec)
    for k in (8, 9):
        s = ds.scale(k)
        key = mcns_spec["scales"][k]["key"]
        assert sorted(p.name for p in (dest / key).iterdir()) == ["0.shard"]
        vol = _precomputed(dest, key)
        assert list(vol.domain.exclusive_max) == list(s.size)
        for box in [[[0, 0, s.size[2] - 150], [150, 120, s.size[2]]],  # across the two files' boundary
                    [[s.size[0] - 90, s.size[1] - 90, 0], list(s.size)]]:
            (x0, y0, z0), (x1, y1, z1) = box
            got = vol[x0:x1, y0:y1, z0:z1].read().result()
            np.testing.assert_array_equal(got, ds.read(box, scale=k))  # the source read
            np.testing.assert_array_equal(got, _truth(s.size, box, "agglomerated"))
    s9 = ds.scale(9)
    whole = [[0, 0, 0], list(s9.size)]
    np.testing.assert_array_equal(_precomputed(dest, mcns_spec["scales"][9]["key"]).read().result(),
                                  _truth(s9.size, whole, "agglomerated"))
    # zarr3 of the same scales, supervoxels: the whole of s9 and the boundary box of s8
    rep = convert(old_mcns, tmp_path / "z", format="zarr3", spec=mcns_spec, scales=[8, 9],
                                          labels="supervoxels", progress=False)
    assert rep.ok and rep.tasks == 2
    z9 = ts.open({"driver": "zarr3", "kvstore": f"file://{tmp_path / 'z'}/s9/"}).result()
    np.testing.assert_array_equal(z9.read().result(), _truth(s9.size, whole))
    s8 = ds.scale(8)
    z8 = ts.open({"driver": "zarr3", "kvstore": f"file://{tmp_path / 'z'}/s8/"}).result()
    np.testing.assert_array_equal(z8[0:150, 0:120, s8.size[2] - 150:].read().result(),
                                  _truth(s8.size, [[0, 0, s8.size[2] - 150], [150, 120, s8.size[2]]]))


def test_convert_old_names_by_default_makes_the_coarser_scales(old_mcns, mcns_spec, tmp_path):
    """Default scales of the old s7-s9: those three, and s10, s11 made from s9 by DVID's rule."""
    from dvidshards.demo import dvid_downsample

    rep = convert(old_mcns, tmp_path / "out", format="precomputed", spec=mcns_spec,
                                          labels="supervoxels", progress=False, scheduler="serial")
    assert rep.ok and rep.scales == [7, 8, 9, 10, 11], rep.summary()
    assert any("s0, s1, s2, s3, s4, s5, s6 not exported and not made" in n for n in rep.notes)
    ds = Dataset(old_mcns, spec=mcns_spec)
    ref = _truth(ds.scale(9).size, [[0, 0, 0], list(ds.scale(9).size)])
    for k in (10, 11):
        ref = dvid_downsample(ref)
        np.testing.assert_array_equal(_precomputed(tmp_path / "out", mcns_spec["scales"][k]["key"]).read().result(),
                                      ref, err_msg=f"s{k}")


def _pyramid_reference(records):
    """s1 and s2 of the real shard's supervoxels by DVID's rule (dvidshards.demo.dvid_downsample, a
    plain numpy port), chunk by chunk: {chunk: (x, y, z) volume} per scale."""
    from dvidshards.demo import dvid_downsample

    def coarser(level):
        # a 2x2x2 cell never straddles two chunks (64 is even): each chunk gives one octant of its parent,
        # and an absent chunk (all 0) gives 0s
        out: dict = {}
        for c, vol in level.items():
            p = tuple(v // 2 for v in c)
            o = [(v % 2) * 32 for v in c]
            dst = out.setdefault(p, np.zeros((64, 64, 64), np.uint64))
            dst[o[0]:o[0] + 32, o[1]:o[1] + 32, o[2]:o[2] + 32] = dvid_downsample(vol)
        return out

    s0 = {(r["chunk_x"], r["chunk_y"], r["chunk_z"]): decode_block(r["block"], np.asarray(r["supervoxels"],
                                                                                         np.uint64)).T
          for r in records}
    s1 = coarser(s0)
    return s1, coarser(s1)


@pytest.mark.slow
def test_convert_s0_only_real_shard_with_the_12_scale_spec(s0_only_real, mcns_spec, real_records, tmp_path):
    """The real mCNS shard as an s0-only export: one convert gives every scale of the spec; s1 and s2
    are DVID's rule on the real supervoxels, and the bodies the records' own mapping of them."""
    dest = tmp_path / "out"
    rep = convert(s0_only_real, dest, format="precomputed", spec=mcns_spec, progress=False,
                                          scheduler="serial")
    assert rep.ok and rep.scales == list(range(12)), rep.summary()
    assert not (tmp_path / "out.work").exists()
    info = json.loads((dest / "info").read_text())
    assert [s["key"] for s in info["scales"]] == [s["key"] for s in mcns_spec["scales"]]
    sv = convert(s0_only_real, tmp_path / "sv", format="precomputed", spec=mcns_spec,
                                         labels="supervoxels", scales=[1, 2], progress=False, scheduler="serial")
    assert sv.ok and sv.scales == [1, 2]
    pairs = {}
    for r in real_records:
        pairs.update(zip(r["supervoxels"], r["labels"], strict=True))
    lut_keys = np.array(sorted(pairs), np.uint64)
    lut_vals = np.array([pairs[k] for k in sorted(pairs)], np.uint64)

    def bodies(v):
        i = np.searchsorted(lut_keys, v)
        out = lut_vals[np.minimum(i, len(lut_keys) - 1)]
        assert (lut_keys[np.minimum(i, len(lut_keys) - 1)][v > 0] == v[v > 0]).all()
        return np.where(v > 0, out, 0)

    s1, s2 = _pyramid_reference(real_records)
    for k, ref in ((1, s1), (2, s2)):
        key = mcns_spec["scales"][k]["key"]
        got_sv, got_body = _precomputed(tmp_path / "sv", key), _precomputed(dest, key)
        for c, want in ref.items():
            lo = np.asarray(c) * 64
            sl = tuple(slice(int(a), int(a) + 64) for a in lo)
            np.testing.assert_array_equal(got_sv[sl].read().result(), want, err_msg=f"s{k} chunk {c}")
            np.testing.assert_array_equal(got_body[sl].read().result(), bodies(want), err_msg=f"s{k} chunk {c}")
        n = len([c for c, v in ref.items() if v.any()])
        assert n > 10 and rep.totals.made["per_scale"][str(k)]["records_written"] == n
