"""formats.downsample: 8 DVID blocks -> 1, against a plain port of DVID's rule and TensorStore's "mode".

The references are independent of the module: ``dvid_port`` is DVID's ``downresArray`` (datatype/
common/labels/compressed.go) written out voxel by voxel, ties to the smaller id as FORMATS.md §3b
fixes them (Go's map order is random); ``by_label`` is the same rule counted label by label with
numpy (for the 128³ regions of real blocks, where the port is too slow); ``mode`` regions go to
``ts.downsample(..., "mode")``. Every output must also be byte for byte what
``encode_block(expected, subblock_order="sorted")`` writes.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import tensorstore as ts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dvidshards.errors import BlockDecodeError
from dvidshards.formats import downsample as ds
from dvidshards.formats import jit
from dvidshards.formats.codec import decode_block, encode_block
from dvidshards.formats.downsample import downsample_block, region_limit
from tests.support.blocks import build_block
from tests.support.data import REAL_SHARD
from tests.support.downsample import by_count, dvid_port
from tests.support.exports import load_shard


@pytest.fixture(autouse=True, params=["compiled", "fallback"])
def kernels(request):
    """Every test through the compiled kernel, then through its numpy fallback (what a fresh
    worker answers with while numba compiles): both are held to the references."""
    if request.param == "compiled":
        ds._down.compile()
        yield request.param
    else:
        with jit.fallbacks():
            yield request.param


# --------------------------------------------------------------------------- references


def by_label(hires: np.ndarray, skip_zero: bool = True) -> np.ndarray:
    """The same rule label by label: each label's votes per cell; a later (larger) label takes a
    cell only with strictly more votes, so ties keep the smaller id."""
    nz, ny, nx = (s // 2 for s in hires.shape)
    cells = hires.reshape(nz, 2, ny, 2, nx, 2)
    best = np.zeros((nz, ny, nx), np.uint64)
    best_n = np.zeros((nz, ny, nx), np.int64)
    for lab in np.unique(hires):
        if skip_zero and lab == 0:
            continue
        n = (cells == lab).sum(axis=(1, 3, 5))
        take = n > best_n
        best[take] = lab
        best_n[take] = n[take]
    return best


def ts_mode(vol: np.ndarray) -> np.ndarray:
    return ts.downsample(ts.array(vol), [2, 2, 2], "mode").read().result()


def mode_expected(region: np.ndarray, limit) -> np.ndarray:
    """TensorStore's mode of the region's in-volume voxels (limit x, y, z), 0 beyond."""
    lx, ly, lz = limit
    out = np.zeros(tuple(s // 2 for s in region.shape), np.uint64)
    if min(limit) > 0:
        m = ts_mode(np.ascontiguousarray(region[:lz, :ly, :lx]))
        out[:m.shape[0], :m.shape[1], :m.shape[2]] = m
    return out


def split(region: np.ndarray, order: str = "sorted", absent_zero: bool = True) -> list:
    """The 8 children of a (z, y, x) region, encoded (None for an all-0 child when absent_zero)."""
    nz, ny, nx = (s // 2 for s in region.shape)
    kids: list = []
    for i in range(8):
        z, y, x = i >> 2, (i >> 1) & 1, i & 1
        part = np.ascontiguousarray(region[z * nz:(z + 1) * nz, y * ny:(y + 1) * ny, x * nx:(x + 1) * nx])
        kids.append(None if absent_zero and not part.any() else encode_block(part, subblock_order=order))
    return kids


def region_of(kids: list, shape) -> np.ndarray:
    nz, ny, nx = shape
    region = np.zeros((2 * nz, 2 * ny, 2 * nx), np.uint64)
    for i, k in enumerate(kids):
        if k is not None:
            z, y, x = i >> 2, (i >> 1) & 1, i & 1
            region[z * nz:(z + 1) * nz, y * ny:(y + 1) * ny, x * nx:(x + 1) * nx] = decode_block(k)
    return region


def check(kids: list, expected: np.ndarray, method: str = "dvid", limit=None):
    """The output equals ``expected`` and is encoded as encode_block would encode it."""
    got = downsample_block(kids, method=method, limit=limit)
    if not expected.any():
        assert got is None
        return
    assert got is not None
    np.testing.assert_array_equal(decode_block(got.block), expected)
    assert got.block == encode_block(expected, subblock_order="sorted")
    n = struct.unpack_from("<I", got.block, 12)[0]
    np.testing.assert_array_equal(got.supervoxels, np.frombuffer(got.block, "<u8", n, 16))


# --------------------------------------------------------------------------- the references agree


def test_references_agree():
    rng = np.random.default_rng(5)
    for _ in range(5):
        v = rng.choice(np.array([0, 0, 3, 9, 2**63, 7], np.uint64), size=(16, 12, 20))
        np.testing.assert_array_equal(dvid_port(v), by_label(v))
        np.testing.assert_array_equal(dvid_port(v), by_count(v))
        np.testing.assert_array_equal(ts_mode(v), by_label(v, skip_zero=False))
        np.testing.assert_array_equal(ts_mode(v), by_count(v, skip_zero=False))


# --------------------------------------------------------------------------- real blocks


def test_fib19_children(fib19_block, fib19_volume, fib19_volume2, kernels):
    """DVID's own encoding of fib19 sample 1 beside sample 2, solid, absent and 0 children."""
    s2 = encode_block(fib19_volume2, subblock_order="appearance")
    solid = encode_block(np.full((64, 64, 64), 12345, np.uint64))
    zero = encode_block(np.zeros((64, 64, 64), np.uint64))
    cases = ([fib19_block, s2, None, solid, zero, fib19_block, s2, None],
             [fib19_block] * 8, [None, None, None, None, None, None, None, s2])
    for kids in cases if kernels == "compiled" else cases[:1]:
        region = region_of(kids, (64, 64, 64))
        check(kids, by_count(region))
        check(kids, by_count(region, skip_zero=False), "mode")
    if kernels == "compiled":  # the plain port on a corner (the port is slow; no kernel in it): the same rule
        region = region_of([fib19_block, s2, None, solid, zero, fib19_block, s2, None], (64, 64, 64))
        corner = region[40:88, 50:78, 30:98]
        np.testing.assert_array_equal(dvid_port(corner), by_count(corner))


@pytest.fixture(scope="module")
def real_shard(dvid_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("real")
    (root / "s1").mkdir()
    (root / "s1" / f"{REAL_SHARD}.arrow").symlink_to(dvid_data / f"{REAL_SHARD}.arrow")
    (root / "s1" / f"{REAL_SHARD}.csv").symlink_to(dvid_data / f"{REAL_SHARD}-newformat.csv")
    sf = load_shard(root, f"s1/{REAL_SHARD}")
    t = sf.table()
    blocks = {tuple(c): t.block(i) for i, c in enumerate(sf.coords.tolist())}
    parents = sorted({(x // 2, y // 2, z // 2) for x, y, z in blocks})
    groups = [[blocks.get((2 * px + (i & 1), 2 * py + ((i >> 1) & 1), 2 * pz + (i >> 2))) for i in range(8)]
              for px, py, pz in parents]
    return groups


def _real(groups, kernels):
    # the fallback takes ~0.2 s a region: a few of them
    return groups if kernels == "compiled" else groups[::25]


def test_real_shard_dvid(real_shard, kernels):
    """Every output block the real mCNS shard's records make (51, most with absent children)."""
    assert len(real_shard) == 51
    for kids in _real(real_shard, kernels)[:12]:
        check(kids, by_count(region_of(kids, (64, 64, 64))))


@pytest.mark.slow
def test_real_shard_dvid_all(real_shard, kernels):
    for kids in _real(real_shard, kernels):
        check(kids, by_count(region_of(kids, (64, 64, 64))))


def test_real_shard_mode(real_shard, kernels):
    for kids in _real(real_shard, kernels)[:12]:
        region = region_of(kids, (64, 64, 64))
        check(kids, ts_mode(region), "mode")
        lim = (128, 101, 77)  # an odd volume edge through the region
        check(kids, mode_expected(region, lim), "mode", lim)


def test_real_blocks_dense(real_shard, kernels):
    """Eight real (multi-label) blocks as one region, in several arrangements."""
    blocks = [k for g in real_shard for k in g if k is not None]
    rng = np.random.default_rng(1)
    for _ in range(4 if kernels == "compiled" else 1):
        kids = [blocks[j] for j in rng.integers(0, len(blocks), 8)]
        region = region_of(kids, (64, 64, 64))
        check(kids, by_count(region))
        check(kids, ts_mode(region), "mode")
    # the plain port on a slab of the last one
    np.testing.assert_array_equal(dvid_port(region[:, 60:64, :]), by_count(region[:, 60:64, :]))


# --------------------------------------------------------------------------- cases by hand


def _solid(label, g=2):
    return struct.pack("<4I", g, g, g, 1) + struct.pack("<Q", label)


def test_solid_and_absent():
    assert downsample_block([None] * 8) is None
    assert downsample_block([_solid(0)] + [None] * 7) is None
    assert downsample_block([_solid(0)] * 8, method="mode") is None
    got = downsample_block([_solid(7)] * 8)
    assert got is not None and got.block == _solid(7) and got.supervoxels.tolist() == [7]
    # one solid child: its octant is that label, the rest 0
    got = downsample_block([None, None, None, _solid(2**64 - 1), None, None, None, None])
    exp = np.zeros((16, 16, 16), np.uint64)
    exp[:8, 8:, 8:] = 2**64 - 1
    np.testing.assert_array_equal(decode_block(got.block), exp)
    assert got.supervoxels.tolist() == [0, 2**64 - 1]


@pytest.mark.parametrize("method", ["dvid", "mode"])
def test_ties_and_zeros(method):
    """Cells with 4+4 votes, zeros against one label, every count of zeros."""
    region = np.zeros((32, 32, 32), np.uint64)
    cells = region.reshape(16, 2, 16, 2, 16, 2).transpose(0, 2, 4, 1, 3, 5).reshape(-1, 8)
    pairs = [(5, 9), (9, 5), (0, 5), (5, 0), (2**64 - 1, 1), (1, 2**64 - 1), (0, 2**63)]
    k = 0
    for a, b in pairs:
        for n_a in range(9):
            for _perm in range(3):
                vals = np.array([a] * n_a + [b] * (8 - n_a), np.uint64)
                cells[k] = np.random.default_rng(k).permutation(vals)
                k += 1
    # three labels in a cell
    cells[k] = [3, 3, 4, 4, 5, 5, 0, 0]
    cells[k + 1] = [3, 4, 5, 6, 7, 8, 9, 0]
    cells[k + 2] = [0, 0, 0, 0, 0, 0, 0, 8]
    cells[k + 3] = [0, 0, 0, 0, 0, 0, 8, 9]
    region[...] = cells.reshape(16, 16, 16, 2, 2, 2).transpose(0, 3, 1, 4, 2, 5).reshape(32, 32, 32)
    exp = dvid_port(region) if method == "dvid" else ts_mode(region)
    for order in ("sorted", "appearance"):
        check(split(region, order), exp, method)
    # by hand (cells[k] is output voxel k): dvid ignores zeros, mode counts them, 0 the smallest id
    w = decode_block(downsample_block(split(region), method=method).block).reshape(-1)

    def at(pair, n_a):
        return int(w[(pairs.index(pair) * 9 + n_a) * 3])

    assert at((5, 9), 4) == 5 and at((9, 5), 4) == 5  # 4 + 4: the smaller
    assert at((2**64 - 1, 1), 4) == 1
    assert at((0, 5), 4) == (5 if method == "dvid" else 0)
    assert at((0, 5), 7) == (5 if method == "dvid" else 0)  # seven zeros, one 5
    assert at((0, 5), 8) == 0
    assert int(w[k]) == (3 if method == "dvid" else 0)
    assert int(w[k + 2]) == (8 if method == "dvid" else 0)
    assert int(w[k + 3]) == (8 if method == "dvid" else 0)


def test_dvid_votes_with_whole_blocks_mode_within_the_volume():
    """Beyond the volume, DVID's blocks still vote (DVID knows no volume size); mode does not."""
    region = np.zeros((32, 32, 32), np.uint64)
    region[:, :, 20:] = 4  # beyond x = 20
    region[:, :, :21] = 3
    kids = split(region)
    check(kids, dvid_port(region), "dvid", (20, 32, 32))
    check(kids, mode_expected(region, (21, 32, 32)), "mode", (21, 32, 32))
    exp = mode_expected(region, (21, 32, 32))
    assert exp[0, 0, 10] == 3 and exp[0, 0, 11] == 0


def test_partial_cells_at_every_edge():
    rng = np.random.default_rng(3)
    region = rng.choice(np.array([0, 1, 2, 3], np.uint64), size=(32, 32, 32), p=[0.4, 0.3, 0.2, 0.1])
    kids = split(region)
    for lim in [(31, 32, 32), (32, 31, 32), (32, 32, 31), (17, 9, 1), (1, 1, 1), (0, 5, 5), (16, 16, 16),
                (15, 17, 3)]:
        check(kids, mode_expected(region, lim), "mode", lim)


def test_region_limit():
    assert region_limit((0, 0, 0), (1000, 1000, 1000)) == (128, 128, 128)
    assert region_limit((128, 256, 0), (150, 200, 129)) == (22, 0, 128)


# --------------------------------------------------------------------------- procedural


_LABELS = st.sampled_from([0, 1, 2, 3, 7, 2**32 + 1, 2**63, 2**64 - 1, 2**64 - 2])


@st.composite
def child_blocks(draw, grid=(2, 2, 2)):
    """A child: absent, solid, a patterned volume (0-heavy, planes, noise), or a block built from
    raw parts (empty sub-blocks, repeated and unused labels in the list)."""
    gz, gy, gx = grid
    shape = (8 * gz, 8 * gy, 8 * gx)
    kind = draw(st.sampled_from(["absent", "solid", "volume", "volume", "raw"]))
    if kind == "absent":
        return None, np.zeros(shape, np.uint64)
    if kind == "solid":
        lab = draw(_LABELS)
        return struct.pack("<4I", gx, gy, gz, 1) + struct.pack("<Q", lab), np.full(shape, lab, np.uint64)
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    palette = np.array(draw(st.lists(_LABELS, min_size=1, max_size=6)), np.uint64)
    if kind == "volume":
        pattern = draw(st.sampled_from(["noise", "planes", "blocky", "zero-heavy", "cells"]))
        if pattern == "noise":
            vol = rng.choice(palette, size=shape)
        elif pattern == "planes":
            vol = np.empty(shape, np.uint64)
            cut = rng.integers(0, 16, 3)
            zz, yy, xx = np.indices(shape)
            vol[...] = palette[((zz < cut[0]) * 1 + (yy < cut[1]) * 2 + (xx < cut[2]) * 4) % len(palette)]
        elif pattern == "blocky":
            g = rng.choice(palette, size=tuple(s // 4 for s in shape))
            vol = np.kron(g, np.ones((4, 4, 4), np.uint64))
        elif pattern == "cells":  # homogeneous 2x2x2 cells
            g = rng.choice(palette, size=tuple(s // 2 for s in shape))
            vol = np.kron(g, np.ones((2, 2, 2), np.uint64))
        else:
            vol = np.where(rng.random(shape) < 0.85, np.uint64(0), rng.choice(palette, size=shape))
        order = draw(st.sampled_from(["sorted", "appearance"]))
        return encode_block(vol, subblock_order=order), vol
    labels = rng.choice(palette, size=int(rng.integers(2, 8)))  # repeats allowed
    subs = []
    for _ in range(gz * gy * gx):
        n = int(rng.integers(0, min(len(labels), 5) + 1))
        ix = rng.choice(len(labels), size=n, replace=False)
        v = rng.integers(0, max(n, 1), size=512)
        subs.append((ix, v))
    data, vol = build_block((gz, gy, gx), labels, subs)
    return data, vol


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(child_blocks(), min_size=8, max_size=8), st.tuples(*[st.integers(0, 32)] * 3))
def test_procedural_children(kernels, children, limit):
    kids = [c[0] for c in children]
    region = np.zeros((32, 32, 32), np.uint64)
    for i, (_, vol) in enumerate(children):
        z, y, x = i >> 2, (i >> 1) & 1, i & 1
        region[16 * z:16 * z + 16, 16 * y:16 * y + 16, 16 * x:16 * x + 16] = vol
    # the voxel-by-voxel port for the kernel; for the fallback the vote table it agrees with (test_references_agree)
    check(kids, dvid_port(region) if kernels == "compiled" else by_count(region), "dvid")
    check(kids, mode_expected(region, (32, 32, 32)), "mode")
    check(kids, mode_expected(region, limit), "mode", limit)


def _pyramid(vol_xyz: np.ndarray, method: str, scales: int, block: int = 16) -> list[np.ndarray]:
    """Scales made block by block with downsample_block, each from the one below, as volumes."""
    out = [vol_xyz]
    size = vol_xyz.shape
    cur = vol_xyz
    for _ in range(1, scales):
        nxt_size = tuple(-(-s // 2) for s in size)
        grid = [-(-s // block) for s in nxt_size]
        pad = np.zeros(tuple(2 * g * block for g in grid), np.uint64)  # x, y, z
        pad[:size[0], :size[1], :size[2]] = cur
        zyx = pad.transpose(2, 1, 0)
        nxt = np.zeros(tuple(g * block for g in grid), np.uint64)
        for bx in range(grid[0]):
            for by in range(grid[1]):
                for bz in range(grid[2]):
                    r = zyx[2 * block * bz:2 * block * (bz + 1), 2 * block * by:2 * block * (by + 1),
                            2 * block * bx:2 * block * (bx + 1)]
                    kids = split(np.ascontiguousarray(r))
                    lim = region_limit((2 * block * bx, 2 * block * by, 2 * block * bz), size, (block,) * 3)
                    got = downsample_block(kids, method=method, limit=lim)
                    if got is not None:
                        nxt[block * bx:block * (bx + 1), block * by:block * (by + 1), block * bz:block * (bz + 1)] = \
                            decode_block(got.block).transpose(2, 1, 0)
        cur = nxt[:nxt_size[0], :nxt_size[1], :nxt_size[2]]
        # beyond the volume the blocks hold 0 (mode: nothing votes there; dvid: the source was 0)
        assert not nxt[nxt_size[0]:].any() and not nxt[:, nxt_size[1]:].any() and not nxt[:, :, nxt_size[2]:].any()
        out.append(cur)
        size = nxt_size
    return out


@pytest.mark.parametrize("shape", [(77, 45, 101), (33, 64, 17), (16, 16, 16), (3, 130, 5)])
def test_odd_sizes_every_scale(kernels, shape):
    """Odd volume sizes at every scale: mode equals TensorStore's mode pyramid, dvid the port's."""
    from dvidshards.demo.neurons import neuron_volume

    if kernels == "fallback" and shape != (33, 64, 17):
        pytest.skip("the fallback on one shape")
    sv, _ = neuron_volume(shape, n_bodies=4, svs_per_body=3, seed=sum(shape))
    sv = np.asarray(sv, np.uint64)
    scales = 1 + max(s - 1 for s in shape).bit_length()
    mode = _pyramid(sv, "mode", scales)
    ref = sv
    for k in range(1, scales):
        ref = ts_mode(ref)
        np.testing.assert_array_equal(mode[k], ref, err_msg=f"mode, scale {k}")
    dvid = _pyramid(sv, "dvid", min(scales, 4))
    ref = sv
    for k in range(1, len(dvid)):
        pad = np.zeros(tuple(s + s % 2 for s in ref.shape), np.uint64)
        pad[:ref.shape[0], :ref.shape[1], :ref.shape[2]] = ref
        ref = by_label(pad.transpose(2, 1, 0)).transpose(2, 1, 0)
        np.testing.assert_array_equal(dvid[k], ref, err_msg=f"dvid, scale {k}")


# --------------------------------------------------------------------------- malformed children


def _bad_children():
    good, _ = build_block((2, 2, 2), [5, 6], [([0, 1], np.arange(512) % 2)] * 8)
    three, _ = build_block((2, 2, 2), [5, 6, 7], [([0, 1, 2], np.arange(512) % 3)] * 8)
    bad_value = bytearray(three)
    bad_value[-1] = 0xFF  # the last packed values of the last sub-block: 3 >= nsb 3
    bad_index = bytearray(good)
    struct.pack_into("<I", bad_index, 16 + 16 + 16 + 4 * 3, 9)  # an index >= N
    return {
        "truncated": (good[:-5], "packed sub-block values need"),
        "short": (b"\x02\x00", "shorter than the 16-byte header"),
        "bad index": (bytes(bad_index), "label index 9 >= N=2"),
        "bad value": (bytes(bad_value), "packed value >= nsb=3 in sub-block 7"),
        "grid": (struct.pack("<4I", 4, 2, 2, 1) + struct.pack("<Q", 1), "differs from"),
        "odd": (struct.pack("<4I", 3, 3, 3, 1) + struct.pack("<Q", 1), "odd"),
        "zstd": (b"\x28\xb5\x2f\xfd" + bytes(40), "zstd frame"),
    }


@pytest.mark.parametrize("case", sorted(_bad_children()))
def test_malformed_child_named(case):
    bad, message = _bad_children()[case]
    good, _ = build_block((2, 2, 2), [5, 6], [([0, 1], np.arange(512) % 2)] * 8)
    kids = [good, None, good, bad, None, good, None, None]
    if case in ("grid", "odd"):
        kids = [good if case == "grid" else None, None, None, bad, None, None, None, None]
    with pytest.raises(BlockDecodeError, match=message) as e:
        downsample_block(kids)
    assert "child (1, 1, 0)" in str(e.value)
    with pytest.raises(BlockDecodeError, match=r"s0/1_2_3\.arrow: chunk \(3, 5, 7\)"):
        downsample_block(kids, names=[f"s0/1_2_3.arrow: chunk {(3 + d, 5, 7)}" for d in (0, 0, 0, 0, 0, 0, 0, 0)],
                         method="mode", limit=(3, 3, 3))


def test_bad_value_outside_the_volume_still_named():
    """A damaged child wholly beyond the volume's edge is still refused (by both paths alike)."""
    bad = _bad_children()["bad value"][0]
    with pytest.raises(BlockDecodeError, match="nsb=3"):
        downsample_block([None, bad, None, None, None, None, None, None], method="mode", limit=(5, 32, 32))


def test_bad_arguments():
    with pytest.raises(ValueError, match="method"):
        downsample_block([None] * 8, method="max")
    with pytest.raises(ValueError, match="8 children"):
        downsample_block([None] * 7)
    with pytest.raises(ValueError, match="limit"):
        downsample_block([None] * 8, method="mode", limit=(1, -1, 1))
