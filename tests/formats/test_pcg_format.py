"""PCG ids, the contact kernel and the protobuf wire format, against independent references."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from dvidshards.errors import DvidShardsError
from dvidshards.formats import pcg
from dvidshards.formats.pcg import IdLayout, PcgError
from tests.support.pcg import brute_force, components_independently, decode_independently

pytest.importorskip("google.protobuf")

# --------------------------------------------------------------------------- independent messages


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def _field(num: int, payload: bytes) -> bytes:
    return _varint(num << 3 | 2) + _varint(len(payload)) + payload


# --------------------------------------------------------------------------- ids


@pytest.mark.parametrize("layers,spatial_bits", [(2, 10), (3, 10), (8, 10), (12, 10), (13, 11), (14, 12),
                                                (18, 16), (6, 4)])
def test_id_layout_bits(layers, spatial_bits):
    # PCG's compute_bitmasks: layer 1 uses layer 2's bits = max(SPATIAL_BITS, layers - 2), and
    # SPATIAL_BITS < layers - 2 is an error
    b = max(spatial_bits, layers - 2)
    lay = IdLayout(layers, spatial_bits)
    assert lay.bits_per_dim == b and lay.counter_bits == 64 - 8 - 3 * b
    top = (1 << b) - 1
    for x, y, z, n in [(0, 0, 0, 1), (1, 2, 3, 5), (top, 0, top, (1 << lay.counter_bits) - 1), (top, top, top, 7)]:
        want = (1 << 56) | (x << (56 - b)) | (y << (56 - 2 * b)) | (z << (56 - 3 * b)) | n
        got = int(lay.node_ids((x, y, z), [n])[0])
        assert got == want, (layers, x, y, z, n)
        assert [int(v[0]) for v in lay.decode([got])] == [1, x, y, z, n]
    assert lay.chunk_id(3, 4, 5, layer=2) == (2 << 56) | (3 << (56 - b)) | (4 << (56 - 2 * b)) | (5 << (56 - 3 * b))


def test_id_layout_other_spatial_bits():
    lay = IdLayout(5, spatial_bits=7)
    assert lay.bits_per_dim == 7 and lay.counter_bits == 35
    assert int(lay.node_ids((127, 1, 2), [9])[0]) == (1 << 56) | (127 << 49) | (1 << 42) | (2 << 35) | 9


def test_id_overflow_is_typed():
    lay = IdLayout(12)  # 10 bits per axis: 1024 chunks
    lay.check_grid((1024, 1, 1))
    with pytest.raises(PcgError, match="1025"):
        lay.check_grid((3, 1025, 4))
    with pytest.raises(PcgError):
        lay.node_ids((1024, 0, 0), [1])
    with pytest.raises(PcgError):
        lay.node_ids((-1, 0, 0), [1])
    with pytest.raises(PcgError, match="segment counter"):
        lay.node_ids((0, 0, 0), [1 << lay.counter_bits])
    with pytest.raises(PcgError):
        lay.node_ids((0, 0, 0), [0])
    with pytest.raises(PcgError, match="not enough"):
        IdLayout(10, spatial_bits=7)  # PCG: SPATIAL_BITS must cover layers - 2
    with pytest.raises(PcgError, match="not enough"):
        IdLayout(13)  # a grid of > 1024 chunks per axis needs SPATIAL_BITS 11
    with pytest.raises(PcgError):
        IdLayout(1)
    with pytest.raises(PcgError):
        IdLayout(20, spatial_bits=19)  # 8 + 57 bits: no counter left
    assert issubclass(PcgError, DvidShardsError) and issubclass(PcgError, ValueError)


@pytest.mark.parametrize("grid,layers", [((1, 1, 1), 2), ((2, 1, 1), 3), ((3, 3, 3), 4), ((526, 306, 368), 12),
                                         ((1024, 5, 5), 12), ((1025, 5, 5), 13)])
def test_layers_for_grid(grid, layers):
    assert pcg.layers_for_grid(grid) == layers


# --------------------------------------------------------------------------- kernel


def run_chunks(vol, cs, layout, affinity="area"):
    """Every chunk of vol through contacts + chunk_graph, with id lists from the voxels."""
    grid = -(-np.asarray(vol.shape) // cs)
    pad = np.pad(vol, 1)

    def ids(c):
        c = np.asarray(c)
        if (c < 0).any() or (c >= grid).any():
            return np.zeros(0, np.uint64)
        lo = c * cs
        u = np.unique(vol[lo[0]:lo[0] + cs[0], lo[1]:lo[1] + cs[1], lo[2]:lo[2] + cs[2]])
        return u[u != 0]

    out = {}
    for c in np.ndindex(*grid):
        lo = np.asarray(c) * cs
        hi = np.minimum(lo + cs, vol.shape)
        sub = pad[lo[0]:hi[0] + 2, lo[1]:hi[1] + 2, lo[2]:hi[2] + 2]
        own, nbs = ids(c), [ids(np.add(c, d)) for d in pcg.DIRECTIONS]
        ct = pcg.contacts(sub.T, own, nbs)
        out[c] = (pcg.chunk_graph(ct, c, own, nbs, layout, affinity), own, nbs)
    return out


def check_against_brute_force(vol, cs):
    layout = IdLayout(pcg.layers_for_grid(-(-np.asarray(vol.shape) // cs)))
    res = run_chunks(vol, cs, layout)
    want, want_vox = brute_force(vol, cs)

    def piece(i):
        _, x, y, z, n = (int(v[0]) for v in layout.decode([i]))
        return int(res[(x, y, z)][1][n - 1]), (x, y, z)

    got, seen = {}, Counter()
    vox = {}
    for c, ((edges, pieces, _), _, _) in res.items():
        for pid, sv, n in zip(*pieces, strict=True):
            assert piece(pid) == (int(sv), c)
            vox[(int(sv), c)] = int(n)
        for t in pcg.EDGE_TYPES:
            n1, n2, aff, area = edges[t]
            assert n1.dtype == n2.dtype == area.dtype == np.uint64 and aff.dtype == np.float32
            keys = list(zip(n1.tolist(), n2.tolist(), strict=True))
            assert keys == sorted(keys) and len(set(keys)) == len(keys)
            for i, j, a, ar in zip(n1.tolist(), n2.tolist(), aff.tolist(), area.tolist(), strict=True):
                p, q = piece(i), piece(j)
                assert p[1] == c  # node_ids1 is in the file's chunk
                if t == "in":
                    assert q[1] == c and i < j and p[0] != q[0]
                elif t == "between":
                    assert q[1] != c and p[0] != q[0]
                else:
                    assert q[1] != c and p[0] == q[0] and ar == 1 and a == np.inf
                k = (p, q) if p < q else (q, p)
                seen[k] += 1
                if t != "cross":
                    assert a == ar
                    got[k] = ar
                else:
                    got[k] = want.get(k)
    assert got == dict(want)
    # in edges once, between/cross once from each side
    for (p, q), n in seen.items():
        assert n == (1 if p[1] == q[1] else 2)
    assert vox == dict(want_vox)


@pytest.mark.parametrize("seed,shape,cs", [(0, (20, 17, 13), (8, 8, 8)), (1, (9, 9, 9), (4, 3, 5)),
                                           (2, (7, 1, 6), (3, 1, 2)), (3, (16, 16, 16), (16, 16, 16))])
def test_contacts_random_volumes(seed, shape, cs):
    rng = np.random.default_rng(seed)
    vol = rng.integers(0, 6, size=shape).astype(np.uint64) * np.uint64((1 << 40) + 3)
    check_against_brute_force(vol, np.asarray(cs))


def test_contacts_neuron_volume():
    from dvidshards.demo.neurons import neuron_volume

    vol, _ = neuron_volume((70, 60, 50), n_bodies=8, svs_per_body=4, seed=4)
    check_against_brute_force(np.ascontiguousarray(vol), np.array([32, 24, 20]))


def test_pair_table_grows():
    """Over 2**15 touching pairs in one chunk: the kernel's pair table is enlarged and rerun."""
    rng = np.random.default_rng(7)
    vol = rng.integers(1, 400, size=(40, 40, 40)).astype(np.uint64)
    pad = np.pad(vol, 1)
    own = np.unique(vol)
    ct = pcg.contacts(pad.T, own, [np.zeros(0, np.uint64)] * 6)
    assert len(ct.in_area) > 1 << 15
    want = Counter()
    for ax in range(3):
        a, b = np.take(vol, range(39), axis=ax).ravel(), np.take(vol, range(1, 40), axis=ax).ravel()
        m = a != b
        lo, hi = np.minimum(a[m], b[m]), np.maximum(a[m], b[m])
        want.update(zip(lo.tolist(), hi.tolist(), strict=True))
    got = {(int(own[i]), int(own[j])): int(n) for (i, j), n in zip(ct.in_pairs, ct.in_area, strict=True)}
    assert got == dict(want)
    np.testing.assert_array_equal(ct.voxels, np.unique(vol, return_counts=True)[1])


def test_contacts_bad_input():
    vol = np.zeros((4, 4, 4), np.uint64)
    vol[1, 1, 1] = 5
    vol[1, 1, 0] = 9  # halo voxel on the -x face
    empty = [np.zeros(0, np.uint64)] * 6
    with pytest.raises(PcgError, match="supervoxel 5"):
        pcg.contacts(vol, [4], empty)
    with pytest.raises(PcgError, match="supervoxel 9"):
        pcg.contacts(vol, [5], empty)
    nb = list(empty)
    nb[0] = np.array([9], np.uint64)
    ct = pcg.contacts(vol, [5], nb)
    assert ct.face_dir.tolist() == [0] and ct.face_pairs.tolist() == [[0, 0]] and ct.face_area.tolist() == [1]
    with pytest.raises(PcgError, match="sorted"):
        pcg.contacts(vol, [7, 5], empty)
    with pytest.raises(PcgError, match="sorted"):
        pcg.contacts(vol, [0, 5], empty)
    with pytest.raises(PcgError, match="uint64"):
        pcg.contacts(vol.astype(np.int64), [5], empty)
    with pytest.raises(PcgError, match="halo"):
        pcg.contacts(vol[:2], [5], empty)
    with pytest.raises(PcgError, match="6 neighbour"):
        pcg.contacts(vol, [5], empty[:5])


def test_affinity_default_and_cross_values():
    vol = np.zeros((4, 3, 3), np.uint64)  # x, y, z: two chunks along x, one supervoxel across + another
    vol[:, 1, 1] = 7
    vol[1, 0, 1] = 8
    layout = IdLayout(3)
    res = run_chunks(vol, np.array([2, 3, 3]), layout, affinity="default")
    edges = res[(0, 0, 0)][0][0]
    assert edges["in"][2].tolist() == [np.finfo(np.float32).tiny] and edges["in"][3].tolist() == [1]
    assert edges["cross"][2].tolist() == [np.inf] and edges["cross"][3].tolist() == [1]
    assert len(edges["between"][0]) == 0
    with pytest.raises(PcgError):
        pcg.chunk_graph(res[(0, 0, 0)][0][0], (0, 0, 0), [], [[]] * 6, layout, affinity="mean")


def test_group_components():
    groups = pcg.group_components([5, 3, 9, 1, 4], [20, 10, 20, 30, 10])
    assert [g.tolist() for g in groups] == [[3, 4], [5, 9], [1]]
    assert pcg.group_components([], []) == []
    with pytest.raises(PcgError):
        pcg.group_components([1, 2], [1])


# --------------------------------------------------------------------------- wire format


def test_empty_chunk_bytes_match_pcg():
    # PCG's put_chunk_edges CopyFroms all three sub-messages: an empty chunk is 0a 00 12 00 1a 00
    assert pcg.encode_edges({}) == bytes.fromhex("0a0012001a00")
    assert pcg.encode_components([]) == b""


def test_edges_wire_format_by_hand():
    n1 = np.array([(1 << 56) | 7, (1 << 56) | 9], np.uint64)
    n2 = np.array([(1 << 56) | 8, (1 << 56) | 10], np.uint64)
    aff = np.array([3, 0.5], np.float32)
    area = np.array([3, 12], np.uint64)
    cross = (n1[:1], n2[1:], np.array([np.inf], np.float32), np.array([1], np.uint64))
    raw = pcg.encode_edges({"in": (n1, n2, aff, area), "cross": cross})
    sub = b"".join(_field(i, a.astype(t).tobytes()) for i, a, t in
                   zip((1, 2, 3, 4), (n1, n2, aff, area), ("<u8", "<u8", "<f4", "<u8"), strict=True))
    csub = b"".join(_field(i, a.astype(t).tobytes()) for i, a, t in
                    zip((1, 2, 3, 4), cross, ("<u8", "<u8", "<f4", "<u8"), strict=True))
    assert raw == _field(1, sub) + _field(2, csub) + _field(3, b"")
    d = decode_independently(raw)
    for k, v in (("in", (n1, n2, aff, area)), ("cross", cross)):
        for a, b in zip(d[k], v, strict=True):
            np.testing.assert_array_equal(a, b)
    assert all(len(a) == 0 for a in d["between"])
    back = pcg.decode_edges(raw)
    for k in pcg.EDGE_TYPES:
        for a, b in zip(back[k], d[k], strict=True):
            np.testing.assert_array_equal(a, b)
            assert a.dtype == b.dtype.newbyteorder("=")


def test_components_wire_format_by_hand():
    groups = [np.array([(1 << 56) | 1, (1 << 56) | 300], np.uint64), np.array([5], np.uint64)]
    raw = pcg.encode_components(groups)
    packed = b"".join(_varint(v) for v in [2, (1 << 56) | 1, (1 << 56) | 300, 1, 5])
    assert raw == _field(1, packed)
    assert components_independently(raw) == [[(1 << 56) | 1, (1 << 56) | 300], [5]]
    assert [g.tolist() for g in pcg.decode_components(raw)] == [g.tolist() for g in groups]


def test_corrupt_payloads_are_typed():
    with pytest.raises(PcgError):
        pcg.decode_edges(b"\x0a\x05\x0a\x03ab")  # truncated sub-message
    with pytest.raises(PcgError, match="whole number"):
        pcg.decode_edges(_field(1, _field(1, b"1234567")))  # 7 bytes of uint64 ids
    with pytest.raises(PcgError, match="different lengths"):
        pcg.decode_edges(_field(1, _field(1, bytes(8))))  # ids without affinities or areas
    with pytest.raises(PcgError, match="claims"):
        pcg.decode_components(_field(1, b"".join(_varint(v) for v in [3, 1, 2])))
    with pytest.raises(PcgError):
        pcg.decode_components(b"\xff\xff")
    with pytest.raises(PcgError, match="different lengths"):
        pcg.encode_edges({"in": ([1], [2, 3], [1.0], [1])})


def test_file_names():
    assert pcg.edges_path((1, 2, 3)) == "edges_1_2_3.proto.zst"
    assert pcg.components_path((10, 0, 255)) == "components_10_0_255.proto"


def test_indexed_volume_equals_raw_ids():
    """A volume already holding 1 + list index (the driver's palette swap) gives the same counts."""
    from dvidshards.demo.neurons import neuron_volume

    vol, _ = neuron_volume((40, 36, 30), n_bodies=6, svs_per_body=3, seed=2)
    pad = np.ascontiguousarray(vol.T)  # z, y, x: the outer layer is the halo
    own = np.unique(pad[1:-1, 1:-1, 1:-1])
    own = own[own != 0]
    faces = [pad[1:-1, 1:-1, 0], pad[1:-1, 1:-1, -1], pad[1:-1, 0, 1:-1], pad[1:-1, -1, 1:-1], pad[0, 1:-1, 1:-1],
             pad[-1, 1:-1, 1:-1]]
    # neighbour lists with extra ids, so that indexes differ from the chunk's
    nbs = [np.union1d(np.unique(f[f != 0]), np.array([1, 2, 1 << 41], np.uint64)) for f in faces]
    idx = np.zeros_like(pad)

    def index(sub, lst, dst):
        k = np.searchsorted(lst, sub).astype(np.uint64) + 1
        dst[...] = np.where(sub == 0, 0, k)

    index(pad[1:-1, 1:-1, 1:-1], own, idx[1:-1, 1:-1, 1:-1])
    for (sl, lst) in zip([np.s_[1:-1, 1:-1, 0], np.s_[1:-1, 1:-1, -1], np.s_[1:-1, 0, 1:-1], np.s_[1:-1, -1, 1:-1],
                          np.s_[0, 1:-1, 1:-1], np.s_[-1, 1:-1, 1:-1]], nbs, strict=True):
        index(pad[sl], lst, idx[sl])
    a = pcg.contacts(pad, own, nbs)
    b = pcg.contacts(idx, own, nbs, indexed=True)
    for f in ("voxels", "in_pairs", "in_area", "face_dir", "face_pairs", "face_area"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    assert len(a.face_area) > 5 and len(a.in_area) > 5
    bad = idx.copy()
    bad[3, 3, 3] = len(own) + 1  # past the end of the chunk's list
    with pytest.raises(PcgError, match="past the end of the chunk's"):
        pcg.contacts(bad, own, nbs, indexed=True)
    bad = idx.copy()
    bad[-1, 5, 5] = len(nbs[5]) + 1  # on the +z halo face
    with pytest.raises(PcgError, match="past the end of its neighbour"):
        pcg.contacts(bad, own, nbs, indexed=True)
