"""formats.jit: kernels answer through fallbacks until numba has compiled them.

A fallback must be indistinguishable from its kernel: the same voxels, record locations and
palettes, and on damaged input the same error (type and text). These tests hold the codec's
numpy decoder, the Arrow IPC reader's interpreted twins and the mapping's numpy look-up to that,
on real and synthetic data and on thousands of damaged inputs; the store matrix
(tests/stores/test_matrix.py) does the same through the whole read path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from dvidshards import Dataset
from dvidshards.errors import DvidShardsError
from dvidshards.formats import blocklayout, blockstats, codec, jit
from dvidshards.formats.mapping import LabelMapping
from dvidshards.stores import MemoryStore
from tests.support.blocks import random_block
from tests.support.data import REAL_SHARD
from tests.support.exports import load_shard, make_export
from tests.support.fuzz import arrow_map

ROOT = Path(__file__).resolve().parents[2]


def _outcome(fn):
    try:
        return ("ok", fn())
    except DvidShardsError as e:
        return ("error", type(e).__name__, str(e))


def _both(fn):
    """fn() with the compiled kernels, then with the fallbacks: each a value or (error type, text)."""
    jit.compile_all()
    compiled = _outcome(fn)
    with jit.fallbacks():
        fallback = _outcome(fn)
    return compiled, fallback


# --- the codec -------------------------------------------------------------------------------------


def _volume(rng, counts) -> np.ndarray:
    """A 64³ (z, y, x) volume whose sub-blocks hold the given numbers of labels, cycled."""
    vol = np.empty((64, 64, 64), np.uint64)
    k = 0
    for sz in range(8):
        for sy in range(8):
            for sx in range(8):
                n = counts[k % len(counts)]
                k += 1
                pool = rng.choice(1 << 20, size=n, replace=False).astype(np.uint64) + 1
                v = np.concatenate([pool, rng.choice(pool, 512 - n)])  # every label of the pool appears
                vol[8 * sz:8 * sz + 8, 8 * sy:8 * sy + 8, 8 * sx:8 * sx + 8] = rng.permutation(v).reshape(8, 8, 8)
    return vol


def _outs():
    """Every kind of output the readers pass: C, F (x contiguous), cropped, strided, one voxel."""
    return [
        np.empty((64, 64, 64), np.uint64),
        np.empty((64, 64, 64), np.uint64, order="F"),
        np.empty((37, 64, 13), np.uint64),
        np.empty((64, 64, 64 * 3), np.uint64)[:, :, ::3],
        np.empty((1, 1, 1), np.uint64),
        np.asfortranarray(np.empty((64, 5, 61), np.uint64)),
    ]


def _decode_both(block: bytes, palette=None, out=None):
    out = out if out is not None else np.empty((64, 64, 64), np.uint64)
    a, b = out.copy(), out.copy()

    def run(o):
        return lambda: (codec.decode_into(np.frombuffer(block, np.uint8), palette, o), o.copy())[1].tobytes()

    jit.compile_all()
    compiled = _outcome(run(a))
    with jit.fallbacks():
        fallback = _outcome(run(b))
    return compiled, fallback


@pytest.mark.parametrize("counts", [[1], [2], [3, 4], [5, 8], [9, 16], [17, 32], [33, 64, 65],
                                    [128, 129], [256, 257], [300, 511, 512], list(range(1, 513, 7))])
def test_codec_fallback_decodes_every_width_and_layout(counts):
    rng = np.random.default_rng(len(counts) * 1000 + counts[0])
    vol = _volume(rng, counts)
    for order in ("appearance", "sorted"):
        block = codec.encode_block(vol, subblock_order=order)
        n = codec.block_header(block).num_labels
        for palette in (None, rng.integers(0, 1 << 63, n, dtype=np.uint64)):
            for out in _outs():
                compiled, fallback = _decode_both(block, palette, out)
                assert compiled[0] == "ok"
                assert fallback == compiled
        got = np.empty((64, 64, 64), np.uint64)
        with jit.fallbacks():
            codec.decode_into(np.frombuffer(block, np.uint8), None, got)
        np.testing.assert_array_equal(got, vol)


def test_codec_fallback_solid_and_empty_subblocks():
    solid = codec.encode_block(np.full((64, 64, 64), 7, np.uint64))
    assert len(solid) == 24
    for out in _outs():
        compiled, fallback = _decode_both(solid, None, out)
        assert fallback == compiled and compiled[0] == "ok"
    # a sub-block with nsb = 0 decodes to 0 (DVID writes it for blocks cut from larger ones)
    vol = _volume(np.random.default_rng(5), [2, 3])
    block = bytearray(codec.encode_block(vol))
    n = int.from_bytes(block[12:16], "little")
    # make sub-block 0 empty: drop its indices and values, set its count to 0
    p_nsb, nsub = 16 + 8 * n, 512
    nsb = np.frombuffer(bytes(block), "<u2", nsub, p_nsb).astype(int)
    p_idx = p_nsb + 2 * nsub
    p_val = p_idx + 4 * int(nsb.sum())
    bits = int(blocklayout.BITS[nsb[0]])
    idx = bytes(block[p_idx + 4 * nsb[0]:p_val])
    vals = bytes(block[p_val + 64 * bits:])
    nsb[0] = 0
    empty = bytes(block[:p_nsb]) + nsb.astype("<u2").tobytes() + idx + vals
    compiled, fallback = _decode_both(empty)
    assert compiled[0] == "ok" and fallback == compiled
    got = np.frombuffer(compiled[1], np.uint64).reshape(64, 64, 64)
    assert not got[:8, :8, :8].any() and (got[8:] == vol[8:]).all()


def test_codec_fallback_on_dvids_own_block(fib19_block, fib19_volume):
    for out in _outs():
        compiled, fallback = _decode_both(fib19_block, None, out)
        assert fallback == compiled and compiled[0] == "ok"
    got = np.empty((64, 64, 64), np.uint64)
    with jit.fallbacks():
        codec.decode_into(np.frombuffer(fib19_block, np.uint8), None, got)
    np.testing.assert_array_equal(got, fib19_volume)


@pytest.mark.parametrize("seed", range(4))
def test_codec_fallback_reports_damage_like_the_kernel(seed):
    """Byte flips, runs of 0xff, truncations and hostile headers: the same error text, or the same voxels."""
    rng = np.random.default_rng(seed)
    base = [codec.encode_block(_volume(rng, c)) for c in ([2, 3, 9], [1, 5, 17, 300], [4])]
    errors = 0
    for trial in range(400):
        d = bytearray(base[trial % len(base)])
        what = rng.integers(0, 4)
        if what == 0:  # a few bytes anywhere, mostly in the header and index arrays
            for _ in range(rng.integers(1, 4)):
                d[int(rng.integers(0, min(len(d), 6000)))] = int(rng.integers(0, 256))
        elif what == 1:
            p = int(rng.integers(0, len(d) - 4))
            d[p:p + 4] = b"\xff\xff\xff\xff"
        elif what == 2:
            d = d[: int(rng.integers(0, len(d)))]
        else:  # a packed value beyond its sub-block's labels, or a grid the output does not fit
            p = int(rng.integers(0, 16))
            d[p] = int(rng.integers(0, 256))
        out = [np.empty((64, 64, 64), np.uint64), np.empty((23, 64, 40), np.uint64)][trial % 2]
        compiled, fallback = _decode_both(bytes(d), None, out)
        assert fallback == compiled, (seed, trial)
        errors += compiled[0] == "error"
    assert errors > 100  # the damage was seen


def _raw_stats(fn, *args):
    """What a kernel (or its fallback) returns, arrays as lists, or the exception's type and text."""
    try:
        r = fn(*args)
    except (TypeError, ValueError) as e:
        return type(e).__name__
    return [v.tolist() if isinstance(v, np.ndarray) else int(v) for v in r]


def test_block_statistics_fallbacks_return_what_the_kernels_return():
    """Codes, counts and boxes, element for element, on random, cropped and damaged blocks, one
    block at a time and in batches."""
    blockstats._batch.compile()
    rng = np.random.default_rng(5)
    tables = (blockstats._FIRST8, blockstats._LAST8, blockstats._REV8)
    blocks, los, his, nls, good = [], [], [], [], []
    errors = 0
    for k in range(60):
        grid = tuple(int(v) for v in rng.integers(1, 4, 3)) if k % 2 else (8, 8, 8)
        block, _ = random_block(rng, grid, int(rng.integers(1, 300)),
                                max_sb_labels=int(rng.choice([2, 3, 4, 6, 9, 40, 300, 512])), zero_frac=0.15)
        if k % 3 == 0:  # damage some: the header, the index arrays, the packed values, the length
            b = bytearray(block)
            for _ in range(int(rng.integers(1, 4))):
                b[int(rng.integers(0, len(b)))] = int(rng.integers(0, 256))
            block = bytes(b[:len(b) - int(rng.integers(0, 3))])
        d = np.frombuffer(block, np.uint8)
        g = 8 * np.array(grid)
        lo = rng.integers(0, g // 2 + 1) if k % 4 else np.zeros(3, np.int64)
        hi = rng.integers(g // 2, g + 9)
        n = int.from_bytes(block[12:16], "little") if len(block) >= 16 and 16 + 8 * int.from_bytes(
            block[12:16], "little") <= len(block) else 0
        one = (d, np.array([0, len(block)]), np.array([lo], np.int64), np.array([hi], np.int64), np.array([n]), *tables)
        outs = [_raw_stats(fn, *one) for fn in (blockstats._batch_kernel, blockstats._batch_numpy)]
        assert outs[0] == outs[1], k
        errors += outs[0][0] != 0
        blocks.append(block), los.append(lo), his.append(hi), nls.append(n), good.append(outs[0][0] == 0)
    assert errors > 10
    args = (np.array(los, np.int64), np.array(his, np.int64), np.array(nls, np.int64), *tables)
    for end in (len(blocks), 1, 0):  # the whole batch (fails at its first damaged block), one good block, none
        ok = [i for i in range(len(blocks)) if good[i]]
        sel = ok[:end] if end < len(blocks) else list(range(len(blocks)))
        o = np.cumsum([0] + [len(blocks[i]) for i in sel]).astype(np.int64)
        b = np.frombuffer(b"".join(blocks[i] for i in sel), np.uint8)
        a = tuple(x[sel] for x in args[:3]) + tables
        want = _raw_stats(blockstats._batch_kernel, b, o, *a)
        assert _raw_stats(blockstats._batch_numpy, b, o, *a) == want
        assert (want[0] != 0) == (end == len(blocks))
    # a header declaring 128³ sub-blocks (4 MiB of counts, all empty but a few): the fallback walks
    # them a bounded number at a time and agrees with the kernel
    g = 128
    nsb = np.zeros(g ** 3, "<u2")
    nsb[[5, 70_000, g ** 3 - 1]] = 1
    hostile = np.frombuffer(np.array([g, g, g, 2], "<u4").tobytes() + np.array([5, 6], "<u8").tobytes()
                            + nsb.tobytes() + np.array([1, 0, 1], "<u4").tobytes(), np.uint8)
    whole = (np.array([0, len(hostile)]), np.zeros((1, 3), np.int64), np.full((1, 3), 1 << 30), np.array([2]), *tables)
    outs = [_raw_stats(fn, hostile, *whole) for fn in (blockstats._batch_kernel, blockstats._batch_numpy)]
    assert outs[0] == outs[1] and outs[0][7] == [512, 1024]  # entry voxels (1024³ - 1536 in empty sub-blocks)
    # arguments the signature refuses are refused by both
    for fn in (blockstats._batch.dispatcher, blockstats._batch_numpy):
        with pytest.raises(TypeError):
            fn(np.zeros(40, np.uint8), np.array([0, 40]), np.zeros((1, 3), np.int32), np.zeros((1, 3), np.int64),
               np.array([1]), *tables)


def test_encoder_fallback_writes_the_kernels_bytes(fib19_block, fib19_volume, real_records):
    """Random volumes of every sub-block width, solid and cropped shapes, both sub-block orders:
    the numpy encoder's bytes are the kernel's; under the fallbacks DVID's own fib19 block and every
    8th of the 258 real mCNS blocks come out byte for byte."""
    codec._encode.compile()
    rng = np.random.default_rng(9)
    for t in range(36):
        shape = tuple(int(8 * v) for v in rng.integers(1, 9, 3)) if t % 3 else (64, 64, 64)
        n = int(rng.choice([1, 2, 3, 5, 9, 40, 300, 2000]))
        labs = rng.integers(0, 2**63, n, dtype=np.uint64)
        idx = rng.integers(0, n, shape) if t % 2 else (np.arange(np.prod(shape)).reshape(shape)
                                                       // int(rng.integers(1, 5000))) % n
        vol = labs[idx]
        if t % 5 == 0:
            vol = np.asfortranarray(vol)  # any layout
        for srt in (False, True):
            assert codec._encode_numpy(vol, srt).tobytes() == codec._encode_kernel(vol, srt).tobytes(), (t, srt)
    with jit.fallbacks():
        assert codec.encode_block(fib19_volume) == fib19_block
        for rec in real_records[::8]:
            assert codec.encode_block(codec.decode_block(rec["block"]), subblock_order="sorted") == rec["block"]
    with pytest.raises(TypeError):
        codec._encode_numpy(np.zeros((8, 8, 8), np.int64), False)

# --- the Arrow IPC reader ----------------------------------------------------------------------


def _shard_outcome(files: dict, spec, origin, policy):
    def run():
        sh = Dataset(MemoryStore(files, name="t"), spec=spec, policy=policy).shard(0, origin)
        t = sh.table()
        return t.rec.tobytes()
    return run


@pytest.fixture(scope="module")
def small_export(tmp_path_factory):
    return make_export(tmp_path_factory.mktemp("jit") / "exp", shape=(130, 100, 70), scales=1)


@pytest.mark.parametrize("policy", ["eager", "lazy"])
def test_ipc_twins_resolve_and_reject_like_the_kernels(small_export, policy):
    root = Path(small_export.root)
    files = {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    key = "s0/0_0_0.arrow"
    amap = arrow_map(files[key])
    rng = np.random.default_rng(11 if policy == "eager" else 12)
    errors = 0
    compiled, fallback = _both(_shard_outcome(files, small_export.spec, (0, 0, 0), policy))
    assert compiled[0] == "ok" and fallback == compiled
    for trial in range(150):
        m = amap.messages[int(rng.integers(0, len(amap.messages)))]
        d = bytearray(files[key])
        for _ in range(int(rng.integers(1, 3))):  # the flatbuffer metadata, where the kernels look
            lo, hi = m.offset, min(m.body_start + 64, len(d))
            d[int(rng.integers(lo, hi))] = int(rng.integers(0, 256))
        damaged = dict(files, **{key: bytes(d)})
        compiled, fallback = _both(_shard_outcome(damaged, small_export.spec, (0, 0, 0), policy))
        assert fallback == compiled, trial
        errors += compiled[0] == "error"
    assert errors > 20


def test_ipc_twins_on_the_real_shard(dvid_data):
    key = f"s1/{REAL_SHARD}"
    files = {f"{key}.arrow": (dvid_data / f"{REAL_SHARD}.arrow").read_bytes(),
             f"{key}.csv": (dvid_data / f"{REAL_SHARD}.csv").read_bytes()}

    def run(files, policy):
        return lambda: load_shard(None, key, policy=policy, store=MemoryStore(files, name="real")).table().rec.tobytes()

    for policy in ("eager", "lazy"):
        compiled, fallback = _both(run(files, policy))
        assert compiled[0] == "ok" and fallback == compiled
    amap = arrow_map(files[f"{key}.arrow"])
    rng = np.random.default_rng(3)
    errors = 0
    for trial in range(30):
        m = amap.batches[int(rng.integers(0, len(amap.batches)))]
        d = bytearray(files[f"{key}.arrow"])
        d[int(rng.integers(m.offset, m.body_start))] = int(rng.integers(0, 256))
        compiled, fallback = _both(run(dict(files, **{f"{key}.arrow": bytes(d)}), "eager"))
        assert fallback == compiled, trial
        errors += compiled[0] == "error"
    assert errors > 5


# --- the mapping ---------------------------------------------------------------------------------


def test_mapping_fallback_maps_like_the_kernel():
    rng = np.random.default_rng(2)
    keys = np.unique(rng.integers(1, 1 << 40, 5000, dtype=np.uint64))
    m = LabelMapping.from_any(np.stack([keys, rng.integers(1, 1 << 40, keys.size, dtype=np.uint64)], axis=1))
    for sv in (rng.choice(keys, 300), rng.integers(0, 1 << 40, 300, dtype=np.uint64),
               np.array([0, keys[0], keys[-1], keys[-1] + 1, np.uint64(2**64 - 1)], np.uint64),
               np.zeros(0, np.uint64), np.concatenate([keys, keys])[::7]):
        compiled, fallback = _both(lambda sv=sv: m.palette(sv).tobytes())
        assert fallback == compiled
    empty = LabelMapping.from_any(np.zeros((0, 2), np.uint64))
    compiled, fallback = _both(lambda: empty.palette(np.arange(5, dtype=np.uint64)).tobytes())
    assert fallback == compiled == ("ok", np.arange(5, dtype=np.uint64).tobytes())



# --- the Kernel object ---------------------------------------------------------------------------


def test_python_twins_call_each_other_without_compiling():
    ns = {"np": np}
    exec(textwrap.dedent("""
        import numba
        @numba.njit
        def inner(x):
            return x * 2
        @numba.njit
        def outer(x):
            return inner(x) + 1
    """), ns)
    twins = jit.python_twins(ns, {"inner": lambda x: x * 3})
    assert twins.outer(5) == 16  # the override is what the twin calls
    assert not ns["outer"].signatures and not ns["inner"].signatures  # nothing compiled

_DEFAULT = textwrap.dedent("""
    import json, threading, numba
    from dvidshards.formats import jit
    jit.install_compiler(jit.Compiler())  # what formats does with no runtime installed
    k = jit.kernel(numba.njit(cache=False)(lambda a, b: a + b), [(numba.int64, numba.int64)], lambda a, b: -(a + b))
    print(json.dumps({"first": k(1, 2), "threads": threading.active_count(), "status": jit.status(),
                      "wait": jit.wait(0)}))
""")


def test_without_a_runtime_a_kernel_compiles_in_the_callers_thread_at_its_first_call(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), PYTHONPATH=str(ROOT))
    env.pop("DVIDSHARDS_KERNELS", None)
    r = subprocess.run([sys.executable, "-c", _DEFAULT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["first"] == 3 and out["threads"] == 1 and out["wait"] is True, out
    assert set(out["status"].values()) == {"compiled"}, out
