"""Tests of dvidshards.formats.multilod: manifests, Draco fragments, shards, cloud-volume reads."""

from __future__ import annotations

import json
from functools import lru_cache

import numpy as np
import pytest

from dvidshards.formats import mesh as M
from dvidshards.formats import multilod as ML
from dvidshards.formats.multiscale import SINGLE_SHARD, Scale, multiscale_info
from dvidshards.formats.sharding import ShardingSpec
from tests.support import meshgrid as G
from tests.support import watertight as W
from tests.support.mesh_volume import OFFSET, RESOLUTION, SIZE

pytest.importorskip("zmesh")
DracoPy = pytest.importorskip("DracoPy")

GRID = G.MeshGrid(OFFSET, SIZE, 64)
BITS = 16


def _write(root, files) -> None:
    for rel, blob in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(blob)


@lru_cache(maxsize=1)
def objects() -> dict[int, list[dict]]:
    from tests.support.mesh_volume import cell_fragments

    return {b: G.build_lods(cells, 3) for b, cells in cell_fragments(0).items()}


@lru_cache(maxsize=1)
def encoded() -> dict[int, tuple[bytes, bytes]]:
    return {b: ML.encode_object(lods, GRID.origin, GRID.cell, BITS) for b, lods in objects().items()}


def _triangles(v: np.ndarray, f: np.ndarray, decimals: int = 2) -> np.ndarray:
    """Faces as sorted rows of rounded corner coordinates, rotated to start at the smallest."""
    t = np.round(np.asarray(v, np.float64)[np.asarray(f, np.int64)], decimals)
    keys = t[:, :, 0] * 1e12 + t[:, :, 1] * 1e6 + t[:, :, 2]
    first = np.argmin(keys, axis=1)
    idx = (first[:, None] + np.arange(3)[None, :]) % 3
    t = np.take_along_axis(t, idx[:, :, None], axis=1).reshape(-1, 9)
    ok = ~((t[:, 0:3] == t[:, 3:6]).all(1) | (t[:, 3:6] == t[:, 6:9]).all(1) | (t[:, 0:3] == t[:, 6:9]).all(1))
    t = t[ok]
    return t[np.lexsort(t.T[::-1])]


def expected_lod_nm(body: int, lod: int) -> M.Mesh:
    manifest, data = encoded()[body]
    frs = ML.decode_object(ML.decode_manifest(manifest), data, lod, BITS)
    v = [f.vertices for f in frs]
    starts = np.cumsum([0] + [len(x) for x in v[:-1]])
    faces = np.concatenate([f.faces.astype(np.int64) + s for f, s in zip(frs, starts, strict=True)])
    return M.to_nm(M.Mesh(np.concatenate(v), faces), RESOLUTION)


def test_manifest_round_trip_and_checks():
    pos = [np.array([[0, 0, 0], [1, 0, 0], [0, 1, 0], [5, 6, 7]]), np.array([[2, 3, 3]])]
    m = ML.Manifest((64.0, 64.0, 64.0), (0.5, -63.5, 64.5), (1.0, 2.0), np.zeros((2, 3)),
                    tuple(pos), (np.array([10, 0, 20, 30]), np.array([7])))
    data = ML.encode_manifest(m)
    assert len(data) == 28 + 2 * 20 + 5 * 16
    back = ML.decode_manifest(data)
    assert back.num_lods == 2 and back.data_size == 67 and back.grid_origin == (0.5, -63.5, 64.5)
    for a, b in zip(back.fragment_positions, pos, strict=True):
        np.testing.assert_array_equal(a, b)
    # positions are stored [3, n]: all x, then all y, then all z
    assert np.frombuffer(data[68:116], "<u4").tolist() == [0, 1, 0, 5, 0, 0, 1, 6, 0, 0, 0, 7]
    with pytest.raises(ML.MeshFormatError, match="Z-curve"):
        ML.encode_manifest(ML.Manifest((1, 1, 1), (0, 0, 0), (1.0,), np.zeros((1, 3)),
                                       (np.array([[1, 0, 0], [0, 0, 0]]),), (np.array([1, 1]),)))
    with pytest.raises(ML.MeshFormatError):
        ML.decode_manifest(data[:-1])


def test_morton_order():
    pos = np.array([[1, 1, 1], [0, 0, 0], [0, 0, 1], [1, 0, 0], [0, 1, 0], [2, 0, 0]])
    assert pos[ML.morton_order(pos)].tolist() == [[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1],
                                                 [1, 1, 1], [2, 0, 0]]


def test_fragment_quantisation_is_exact():
    rng = np.random.default_rng(0)
    lo, size = np.array([0.5, -63.5, 64.5]), np.array([64.0, 64.0, 64.0])
    v = lo + rng.random((50, 3)) * size
    v[:5, 0] = lo[0]  # on the low face
    v[5:10, 1] = lo[1] + size[1]  # on the high face
    mesh = M.Mesh(v, rng.integers(0, 50, (80, 3)))
    for bits in (10, 16):
        blob = ML.encode_fragment(mesh, lo, size, bits)
        top = (1 << bits) - 1
        q = np.floor((v - lo) / size * top + 0.5)
        pts = np.asarray(DracoPy.decode(blob).points, np.float64)
        # Draco's own quantisation maps each integer to itself (neuroglancer reads the integers)
        used = np.unique(mesh.faces)  # Draco drops unreferenced vertices
        assert {tuple(p) for p in pts.tolist()} == {tuple(p) for p in q[used].tolist()}
        back = ML.decode_fragment(blob, lo, size, bits)
        assert _triangles(back.vertices, back.faces, 3).shape[0] > 0
        want = (lo + size * q[used] / top).astype(np.float32)
        np.testing.assert_array_equal(np.unique(back.vertices, axis=0), np.unique(want, axis=0))
        assert np.abs(want - v[used]).max() <= size.max() / top
    with pytest.raises(ML.MeshFormatError):
        ML.encode_fragment(mesh, lo + 10, size)
    assert ML.encode_fragment(M.Mesh.empty(), lo, size) == b""


def _neuroglancer_partition(q: np.ndarray, faces: np.ndarray, bits: int) -> np.ndarray:
    """Octant mask of each face as neuroglancer_draco.cc computes it (0: crosses the partition)."""
    pp = ((1 << bits) - 1) // 2 + 1
    mask = np.full(len(q), 0xFF, np.int64)
    for axis, (low, high) in enumerate(((0b01010101, 0b10101010), (0b00110011, 0b11001100),
                                         (0b00001111, 0b11110000))):
        mask = np.where(q[:, axis] < pp, mask & low, np.where(q[:, axis] > pp, mask & high, mask))
    return mask[faces[:, 0]] & mask[faces[:, 1]] & mask[faces[:, 2]]


def test_levels_meet_and_respect_the_partition():
    for body, (manifest_bytes, data) in encoded().items():
        manifest = ML.decode_manifest(manifest_bytes)
        assert manifest.num_lods == len(objects()[body]) >= 2
        start = 0
        for lod in range(manifest.num_lods):
            # fragments of one level weld into a closed surface: no crack between them
            frs = ML.decode_object(manifest, data, lod, BITS)
            merged = M.merge_fragments(frs)
            assert W.is_watertight(merged.vertices, merged.faces), (body, lod)
            for n in manifest.fragment_sizes[lod].tolist():
                if lod and n:
                    d = DracoPy.decode(data[start:start + n])
                    q = np.asarray(d.points, np.int64)
                    assert (_neuroglancer_partition(q, np.asarray(d.faces), BITS) != 0).all()
                start += n


def _write_volume(tmp_path, mesh_files: dict[str, bytes]) -> str:
    info = multiscale_info([Scale(0, SIZE, RESOLUTION, SINGLE_SHARD, (64, 64, 64), OFFSET)])
    info["mesh"] = "mesh"
    files = {"info": json.dumps(info).encode()}
    files.update({f"mesh/{k}": v for k, v in mesh_files.items()})
    _write(tmp_path, files)
    return f"file://{tmp_path}"


SHARDINGS = {
    "unsharded": None,
    "sharded": ShardingSpec(0, 1, 1, "murmurhash3_x86_128", minishard_index_encoding="gzip"),
    "one-shard": ShardingSpec(0, 0, 0, "identity"),
}


@pytest.mark.parametrize("name", list(SHARDINGS))
def test_cloudvolume_reads_multilod(tmp_path, name):
    CloudVolume = pytest.importorskip("cloudvolume").CloudVolume
    files = G.multilod_files(objects(), RESOLUTION, GRID.origin, GRID.cell, bits=BITS,
                              sharding=SHARDINGS[name])
    cv = CloudVolume(_write_volume(tmp_path, files))
    assert cv.mesh.meta.info["@type"] == ML.MULTILOD_TYPE
    for body, lods in objects().items():
        for lod in range(len(lods)):
            got = (cv.mesh.get(body, lod=lod) if SHARDINGS[name] else cv.mesh.get([body], lod=lod))[body]
            want = expected_lod_nm(body, lod)
            # cloud-volume dequantises in its own float arithmetic: equal up to ~1e-3 nm
            np.testing.assert_allclose(_triangles(got.vertices, got.faces),
                                       _triangles(want.vertices, want.faces), atol=0.02, rtol=0)


def test_cloudvolume_reads_legacy(tmp_path):
    CloudVolume = pytest.importorskip("cloudvolume").CloudVolume
    from tests.support.mesh_volume import cell_fragments

    frs = cell_fragments(0)
    cv = CloudVolume(_write_volume(tmp_path, ML.legacy_files(frs, RESOLUTION)))
    for body, cells in frs.items():
        got = cv.mesh.get(body)
        got = got[body] if isinstance(got, dict) else got
        want = M.to_nm(M.merge_fragments(cells.values()), RESOLUTION)
        np.testing.assert_array_equal(_triangles(got.vertices, got.faces, 3),
                                      _triangles(want.vertices, want.faces, 3))
    cell = sorted(frs[1])[0]
    blob = (tmp_path / "mesh" / f"1:0:{cell[0]}_{cell[1]}_{cell[2]}").read_bytes()
    m = ML.decode_legacy_fragment(blob)
    np.testing.assert_array_equal(m.vertices, M.to_nm(frs[1][cell], RESOLUTION).vertices)
    with pytest.raises(ML.MeshFormatError):
        ML.decode_legacy_fragment(blob[:-4])


def test_shard_files_read_by_tensorstore(tmp_path):
    ts = pytest.importorskip("tensorstore")
    spec = ShardingSpec(2, 2, 2, "murmurhash3_x86_128", minishard_index_encoding="gzip",
                        data_encoding="gzip")
    rng = np.random.default_rng(3)
    entries = {int(k): rng.bytes(int(rng.integers(0, 40))) for k in rng.integers(0, 2**63, 60)}
    entries[0] = b"zero"
    files = ML.encode_shard_files(spec, entries)
    assert len(files) > 1 and all(k.endswith(".shard") for k in files)
    _write(tmp_path, files)
    kv = ts.KvStore.open({"driver": "neuroglancer_uint64_sharded", "base": f"file://{tmp_path}/",
                          "metadata": spec.to_json()}).result()
    for key, value in entries.items():
        assert kv.read(key.to_bytes(8, "big")).result().value == value
    assert kv.read((12345).to_bytes(8, "big")).result().state == "missing"
    with pytest.raises(ML.MeshFormatError):
        ML.encode_shard_files(spec, entries, {0: b"prefix"})


def test_info_files():
    info = ML.multilod_info(RESOLUTION, 10)
    assert info["transform"] == [8.0, 0, 0, 0, 0, 8.0, 0, 0, 0, 0, 16.0, 0]
    assert info["vertex_quantization_bits"] == 10 and "sharding" not in info
    with pytest.raises(ML.MeshFormatError):
        ML.multilod_info(RESOLUTION, 12)
    with pytest.raises(ML.MeshFormatError):
        ML.multilod_info(RESOLUTION, sharding=ShardingSpec(0, 0, 0, "identity", data_encoding="gzip"))
    assert ML.legacy_info() == {"@type": "neuroglancer_legacy_mesh"}


def test_shard_files_byte_identical_to_tensorstore(tmp_path):
    ts = pytest.importorskip("tensorstore")
    spec = ShardingSpec(1, 2, 2, "murmurhash3_x86_128")
    rng = np.random.default_rng(5)
    entries = {int(k): rng.bytes(int(rng.integers(1, 40))) for k in rng.integers(0, 2**63, 60)}
    kv = ts.KvStore.open({"driver": "neuroglancer_uint64_sharded", "base": f"file://{tmp_path}/",
                          "metadata": spec.to_json()}).result()
    with ts.Transaction() as txn:
        for key, value in entries.items():
            kv.with_transaction(txn)[key.to_bytes(8, "big")] = value
    files = ML.encode_shard_files(spec, entries)
    assert sorted(files) == sorted(p.name for p in tmp_path.iterdir())
    for name, blob in files.items():
        assert (tmp_path / name).read_bytes() == blob


def test_vertex_offsets_shift_decoded_levels():
    lods = objects()[1]
    shift = np.array([[0, 0, 0], [-63.5, -63.5, -63.5], [2.0, 0.0, -1.0]])[:len(lods)]
    man, data = ML.encode_object(lods, GRID.origin, GRID.cell, BITS, vertex_offsets=shift)
    plain_man, plain = encoded()[1]
    m = ML.decode_manifest(man)
    np.testing.assert_array_equal(m.vertex_offsets, shift.astype(np.float32))
    assert data == plain  # the fragments are the same; the viewer adds the offsets
    for lod in range(len(lods)):
        a = ML.decode_object(m, data, lod, BITS)
        b = ML.decode_object(ML.decode_manifest(plain_man), plain, lod, BITS)
        for x, y in zip(a, b, strict=True):
            np.testing.assert_allclose(x.vertices, y.vertices + shift[lod].astype(np.float32), atol=1e-3)
    with pytest.raises(ML.MeshFormatError):
        ML.encode_object(lods, GRID.origin, GRID.cell, BITS, vertex_offsets=np.zeros((len(lods) + 1, 3)))
