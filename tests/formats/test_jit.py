"""formats.jit and runtime.kernels: kernels answer through fallbacks until numba has compiled them.

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
import time
from pathlib import Path

import numba
import numpy as np
import pytest

from dvidshards import Dataset
from dvidshards.errors import DvidShardsError
from dvidshards.formats import blocklayout, blockstats, codec, jit
from dvidshards.formats.blockstats import new_accumulators
from dvidshards.formats.mapping import LabelMapping
from dvidshards.runtime import kernels as rk
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
    """Codes, counts and boxes, element for element, on random, cropped and damaged blocks; the
    batch kernel's rows too."""
    blockstats._kernel.compile()
    blockstats._batch.compile()
    rng = np.random.default_rng(5)
    tables = (blockstats._FIRST8, blockstats._LAST8, blockstats._REV8)
    blocks, los, his, nls = [], [], [], []
    errors = 0
    for k in range(150):
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
        outs = []
        for fn in (blockstats._stats_kernel, blockstats._stats_numpy):
            counts, boxes = new_accumulators(n)
            r = _raw_stats(fn, d, *(int(v) for v in lo), *(int(v) for v in hi), counts, boxes, *tables)
            outs.append((r, counts.tolist(), boxes.tolist()) if r[0] == 0 else r)
        assert outs[0] == outs[1], k
        errors += outs[0][0] != 0 if isinstance(outs[0], list) else 0
        blocks.append(block), los.append(lo), his.append(hi), nls.append(n)
    assert errors > 20
    args = (np.array(los, np.int64), np.array(his, np.int64), np.array(nls, np.int64), *tables)
    for end in (len(blocks), 1, 0):  # the whole batch (fails at its first damaged block), one good block, none
        ok = [i for i in range(len(blocks)) if _raw_stats(blockstats._stats_kernel, np.frombuffer(blocks[i], np.uint8),
                                                       *(int(v) for v in los[i]), *(int(v) for v in his[i]),
                                                       *new_accumulators(nls[i]), *tables)[0] == 0]
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
    outs = []
    for fn in (blockstats._stats_kernel, blockstats._stats_numpy):
        counts, boxes = new_accumulators(2)
        outs.append((_raw_stats(fn, hostile, 0, 0, 0, 1 << 30, 1 << 30, 1 << 30, counts, boxes, *tables),
                     counts.tolist(), boxes.tolist()))
    assert outs[0] == outs[1] and outs[0][1] == [512, 1024, 1024 ** 3 - 1536]
    # arguments the signature refuses are refused by both
    counts, boxes = new_accumulators(3)
    for fn in (blockstats._kernel.dispatcher, blockstats._stats_numpy):
        with pytest.raises(TypeError):
            fn(np.zeros(40, np.uint8), 0, 0, 0, 8, 8, 8, counts.astype(np.int32), boxes, *tables)


def test_encoder_fallback_writes_the_kernels_bytes(fib19_block, fib19_volume, real_records):
    """Random volumes of every sub-block width, solid and cropped shapes, both sub-block orders:
    the numpy encoder's bytes are the kernel's; under the fallbacks DVID's own fib19 block and the
    258 real mCNS blocks come out byte for byte."""
    codec._encode.compile()
    rng = np.random.default_rng(9)
    for t in range(120):
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
        for rec in real_records[::5]:
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


@numba.njit(cache=False)
def _add(a, b):
    return a + b


def _kernel(fallback=lambda a, b: -(a + b)):
    # the fallback answers differently here only so that the tests can tell who answered
    return jit.Kernel(numba.njit(cache=False)(_add.py_func), [(numba.int64, numba.int64)], fallback,
                      exclusive=True)


def test_kernel_modes(monkeypatch):
    monkeypatch.setenv("DVIDSHARDS_KERNELS", "fallback")
    k = _kernel()
    assert k(2, 3) == -5 and not k.ready
    monkeypatch.setenv("DVIDSHARDS_KERNELS", "compiled")
    assert k(2, 3) == 5 and k.ready
    with jit.fallbacks():
        assert k(2, 3) == -5
    assert k(2, 3) == 5
    monkeypatch.setenv("DVIDSHARDS_KERNELS", "background")
    k = _kernel()
    assert k(2, 3) == -5  # answered at once, compiled behind
    assert jit.wait(timeout=120)
    assert k.ready and k(2, 3) == 5
    with pytest.raises(TypeError):  # exclusive: no second signature is compiled in the caller's thread
        k(np.zeros(3), 3)
    monkeypatch.setenv("DVIDSHARDS_KERNELS", "sometimes")
    with pytest.raises(ValueError, match="DVIDSHARDS_KERNELS"):
        _kernel()(1, 1)


def test_a_kernel_numba_cannot_compile_keeps_its_fallback(monkeypatch):
    @numba.njit(cache=False)
    def bad(a, b):
        return object()  # not supported in nopython mode

    k = jit.Kernel(bad, [(numba.int64, numba.int64)], lambda a, b: a * b)
    monkeypatch.setenv("DVIDSHARDS_KERNELS", "compiled")
    with pytest.warns(RuntimeWarning, match="could not compile"):
        assert k(3, 4) == 12
    assert k.failed is not None and not k.ready
    assert k(3, 4) == 12  # no second attempt, no second warning
    assert "failed" in repr(k)


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


# --- a fresh process -------------------------------------------------------------------------------


def test_fresh_process_reads_before_numba_has_compiled(tmp_path, small_export):
    """With an empty numba cache the first chunks read at once, exactly; numba compiles behind."""
    want = small_export.expected(0)[64:128, 0:64, 0:64]
    np.save(tmp_path / "want.npy", want)
    script = textwrap.dedent(f"""
        import json, sys
        import numpy as np
        import dvidshards
        import dvidshards.runtime
        from dvidshards.formats import jit
        ds = dvidshards.Dataset({small_export.root!r})
        a = ds.open(0)[64:128, 0:64, 0:64].read(order="F").result()
        b = ds.read([[64, 0, 0], [128, 64, 64]], scale=0)
        want = np.load({str(tmp_path / "want.npy")!r})
        print(json.dumps({{"open": bool((a == want).all()), "read": bool((b == want).all()),
                          "status": jit.status()}}))
    """)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), PYTHONPATH=str(ROOT))
    env.pop("DVIDSHARDS_KERNELS", None)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["open"] and out["read"]
    # the reads did not wait for numba: when they were done, some kernel was still compiling
    assert set(out["status"].values()) & {"queued", "compiling"}, out["status"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_starts_its_own_compiler(monkeypatch):
    """A child forked while the parent compiles gets no compiler thread: it must start one."""
    monkeypatch.setenv("DVIDSHARDS_KERNELS", "background")
    script = textwrap.dedent("""
        import os, sys, numba
        import dvidshards.runtime
        from dvidshards.formats import jit
        numba.njit(lambda a: a)(1)  # numba imports its typing modules on a first compile: not mid-fork
        k = jit.kernel(numba.njit(cache=False)(lambda a, b: a + b), [(numba.int64, numba.int64)],
                       lambda a, b: -(a + b))
        assert k(1, 2) == -3  # queued in the parent, compiling now
        pid = os.fork()
        if pid == 0:
            ok = k(1, 2) == -3 and jit.wait(timeout=120) and k.ready and k(1, 2) == 3
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr


def test_a_kernel_without_fallback_compiles_at_first_call_in_every_mode(monkeypatch):
    """A kernel without a fallback compiles once at its first call and waits for it, in every mode."""
    for m in ("background", "fallback", "compiled"):
        monkeypatch.setenv("DVIDSHARDS_KERNELS", m)
        k = jit.Kernel(numba.njit(cache=False)(_add.py_func), [(numba.int64, numba.int64)], None, exclusive=True)
        assert k(2, 3) == 5 and k.ready
        with jit.fallbacks():
            assert k(2, 3) == 5  # nothing else can answer


# --- the helper process ----------------------------------------------------------------------------

_CALLER = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from dvidshards.formats import jit, mapping
    from dvidshards.runtime import kernels as rk
    keys, values = np.array([1, 2], np.uint64), np.array([5, 6], np.uint64)
    out = np.zeros(3, np.uint64)
    mapping._apply_k(np.array([1, 2, 3], np.uint64), keys, values, out)  # the fallback answers
    got = out.tolist()
    for _ in range(6000):  # until the kernel is with the helper (it is blocked on the test's lock)
        if jit.status().get(mapping._apply_k.name) == "compiling" and rk._helper is not None:
            break
        time.sleep(0.01)
    print(json.dumps({"got": got, "status": jit.status(), "helper": rk._helper.pid}))
""")

_LOADER = textwrap.dedent("""
    import json
    import numpy as np
    from dvidshards.formats import jit, mapping
    from dvidshards.runtime import kernels as rk
    cached = rk.in_cache(mapping._apply_k)
    keys, values = np.array([1, 2], np.uint64), np.array([5, 6], np.uint64)
    out = np.zeros(3, np.uint64)
    mapping._apply_k(np.array([1, 2, 3], np.uint64), keys, values, out)
    jit.wait(timeout=300)
    d = mapping._apply_k.dispatcher
    got = np.zeros(3, np.uint64)
    mapping._apply_k(np.array([1, 2, 3], np.uint64), keys, values, got)
    print(json.dumps({"cached": cached, "ready": mapping._apply_k.ready, "helper": rk._helper is not None,
                      "hits": sum(d._cache_hits.values()), "misses": sum(d._cache_misses.values()),
                      "got": got.tolist() if (got == out).all() else None}))
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX: flock")
@pytest.mark.slow  # child processes that compile
def test_exit_leaves_the_compile_to_the_helper_which_fills_the_cache(tmp_path, monkeypatch):
    """A process exits while its kernel is still being compiled: the helper process (blocked here
    on the cache lock the test holds) finishes it into numba's cache, where the next process
    loads it without compiling and without a helper."""
    import fcntl

    from dvidshards.formats import mapping

    cache = tmp_path / "numba"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    env.pop("DVIDSHARDS_KERNELS", None)
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(cache))
    with open(rk._lock_path(mapping._apply_k), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            r = subprocess.run([sys.executable, "-c", _CALLER], capture_output=True, text=True, env=env,
                               timeout=300, cwd=str(tmp_path))  # a wait for the helper would never end
            assert r.returncode == 0, r.stderr
            out = json.loads(r.stdout.strip().splitlines()[-1])
            assert out["got"] == [5, 6, 3] and out["status"][mapping._apply_k.name] == "compiling", out
            os.kill(out["helper"], 0)  # still there, after its parent has gone
            assert not list(cache.rglob("mapping._apply-*.nbi"))
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    for _ in range(3000):  # the helper compiles now
        if list(cache.rglob("mapping._apply-*.nbi")):
            break
        time.sleep(0.1)
    r = subprocess.run([sys.executable, "-c", _LOADER], capture_output=True, text=True, env=env, timeout=300,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"cached": True, "ready": True, "helper": False, "hits": 1, "misses": 0, "got": [5, 6, 3]}, out


_TWO_KERNELS = textwrap.dedent("""
    import numba
    from dvidshards.formats import jit

    def _twice(a):
        return 2 * a

    def _thrice(a):
        return 3 * a

    twice = jit.kernel(numba.njit(cache=True)(_twice), [(numba.int64,)], lambda a: -2 * a)
    thrice = jit.kernel(numba.njit(cache=True)(_thrice), [(numba.int64,)], lambda a: -3 * a)
""")

_IDLE_CALLER = textwrap.dedent("""
    import json, time
    from dvidshards.formats import jit
    from dvidshards.runtime import kernels as rk
    import twokernels as m
    rk._HELPER_IDLE = 0.5
    out = {"first": m.twice(4)}  # the fallback (negative) answers
    assert jit.wait(timeout=300)
    out["twice"] = m.twice(4)
    first = rk._helper
    for _ in range(3000):  # the idle helper goes away, and is reaped
        if rk._helper is None and first.poll() is not None:
            break
        time.sleep(0.01)
    out["exited"] = first.returncode
    out["second"] = m.thrice(4)
    assert jit.wait(timeout=300)
    out["thrice"] = m.thrice(4)
    out["starts"] = rk._helper_starts
    out["broken"] = rk._helper_broken
    print(json.dumps(out))
""")


@pytest.mark.slow  # child processes that compile
def test_an_idle_helper_exits_and_a_new_one_starts_when_needed(tmp_path):
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "twokernels.py").write_text(_TWO_KERNELS)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"),
               PYTHONPATH=os.pathsep.join([str(tmp_path / "mods"), str(ROOT)]))
    env.pop("DVIDSHARDS_KERNELS", None)
    r = subprocess.run([sys.executable, "-c", _IDLE_CALLER], capture_output=True, text=True, env=env, timeout=600,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"first": -8, "twice": 8, "exited": 0, "second": -12, "thrice": 12, "starts": 2,
                   "broken": False}, out
    assert list((tmp_path / "numba").rglob("twokernels._thrice-*.nbi"))  # compiled by the second helper



# --- jobs: compiled at normal priority, once per node (runtime.kernels.prepare_for_job) ------------

_JOB = textwrap.dedent("""
    import json, os, sys, time
    from dvidshards.formats import jit
    from dvidshards.runtime import kernels as rk
    import twokernels as m
    while not os.path.exists(sys.argv[1]):  # start with the other process
        time.sleep(0.002)
    rk.prepare_for_job()  # job mode only: each kernel is compiled at its first call
    first = {"twice": m.twice(4), "thrice": m.thrice(4)}
    assert jit.wait(timeout=300)
    out = {}
    for name, k in (("twice", m.twice), ("thrice", m.thrice)):
        d = k.dispatcher
        out[name] = {"first": first[name], "after": k(4), "misses": sum(d._cache_misses.values()),
                     "hits": sum(d._cache_hits.values())}
    out["helper"] = rk._helper_starts
    print(json.dumps(out))
""")


def _mods(tmp_path) -> dict:
    (tmp_path / "mods").mkdir(exist_ok=True)
    (tmp_path / "mods" / "twokernels.py").write_text(_TWO_KERNELS)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"),
               PYTHONPATH=os.pathsep.join([str(tmp_path / "mods"), str(ROOT)]))
    env.pop("DVIDSHARDS_KERNELS", None)
    return env


def test_two_fresh_job_workers_compile_each_kernel_once_and_start_no_helper(tmp_path):
    """Two job processes starting together on an empty cache: every kernel is compiled once on
    the node (numba's cache misses over both processes), by whichever process called it first,
    whose call then ran the compiled code; the other loaded it from the cache. No helper process."""
    env = _mods(tmp_path)
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", _JOB, str(go)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path)) for _ in range(2)]
    go.write_text("")
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stderr
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    for name, want in (("twice", 8), ("thrice", 12)):
        assert sum(o[name]["misses"] for o in outs) == 1, outs  # compiled once on the node
        for o in outs:
            assert o[name]["after"] == want and o[name]["misses"] + o[name]["hits"] == 1, outs
            if o[name]["misses"]:  # the process that compiled it ran its first call compiled
                assert o[name]["first"] == want, outs
            else:
                assert o[name]["first"] in (want, -want), outs
    assert [o["helper"] for o in outs] == [0, 0]


_BLOCKED = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from dvidshards.formats import jit, mapping
    from dvidshards.runtime import kernels as rk
    rk.prepare_for_job(mapping._apply_k, wait=False)  # another process holds its lock: this one goes on
    keys, values = np.array([1, 2], np.uint64), np.array([5, 6], np.uint64)
    out = np.zeros(3, np.uint64)
    mapping._apply_k(np.array([1, 2, 3], np.uint64), keys, values, out)  # the fallback answers
    print(json.dumps({"got": out.tolist(), "ready": mapping._apply_k.ready,
                      "status": jit.status().get(mapping._apply_k.name)}), flush=True)
    sys.stdin.readline()  # the test lets go of the lock
    assert jit.wait(timeout=300)
    d = mapping._apply_k.dispatcher
    print(json.dumps({"ready": mapping._apply_k.ready, "misses": sum(d._cache_misses.values()),
                      "helper": rk._helper_starts}), flush=True)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX: flock")
def test_a_job_answers_through_the_fallback_while_another_process_compiles(tmp_path, monkeypatch):
    """prepare_for_job(wait=False): a kernel another process compiles answers through its fallback,
    and is loaded (here: compiled, the other wrote nothing) once that process lets go."""
    import fcntl

    from dvidshards.formats import mapping

    env = _mods(tmp_path)
    monkeypatch.setenv("NUMBA_CACHE_DIR", env["NUMBA_CACHE_DIR"])  # the lock file is named after it
    with open(rk._kernel_lock_path(mapping._apply_k), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as a process compiling the kernel would
        p = subprocess.Popen([sys.executable, "-c", _BLOCKED], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path))
        try:
            assert p.stdout is not None and p.stdin is not None
            first = json.loads(p.stdout.readline() or "null")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    if first is None or first.pop("status") not in ("queued", "compiling"):  # in the job thread's hands
        p.kill()
        pytest.fail(f"{first}: {p.communicate()[1]}")
    assert first == {"got": [5, 6, 3], "ready": False}
    p.stdin.write("go\n")
    p.stdin.flush()
    stdout, stderr = p.communicate(timeout=600)
    assert p.returncode == 0, stderr
    # the lock's holder wrote nothing to the cache: this process compiled it itself, no helper
    assert json.loads(stdout.strip().splitlines()[-1]) == {"ready": True, "misses": 1, "helper": 0}


_PREPARE = textwrap.dedent("""
    import json, numba
    from dvidshards.errors import SpecError
    from dvidshards.formats import jit, mapping
    from dvidshards.runtime import kernels as rk
    import twokernels as m
    out = {}
    rk.prepare_for_job("twokernels", "dvidshards.formats.mapping._apply")  # a module, a kernel's name
    out["ready"] = [m.twice.ready, m.thrice.ready, mapping._apply_k.ready]
    calls = []
    real = rk._resolve
    rk._resolve = lambda t: calls.append(t) or real(t)
    rk.prepare_for_job("twokernels", "dvidshards.formats.mapping._apply")
    out["again"] = len(calls)  # done: nothing resolved again
    for bad in ("dvidshards.formats.nosuchthing", "dvidshards.errors"):
        try:
            rk.prepare_for_job(bad)
        except SpecError as e:
            out.setdefault("errors", []).append(str(e))
    k = jit.Kernel(numba.njit(cache=False)(lambda a: a + 1), [(numba.int64,)], lambda a: -a)
    out["uncached"] = k(1)  # not cacheable (not registered): compiled here at its first call
    print(json.dumps(out))
""")


def test_prepare_for_job_names_kernels_and_modules_and_is_cheap_once_done(tmp_path):
    env = _mods(tmp_path)
    r = subprocess.run([sys.executable, "-c", _PREPARE], capture_output=True, text=True, env=env, timeout=600,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ready"] == [True, True, True] and out["again"] == 0 and out["uncached"] == 2, out
    assert len(out["errors"]) == 2 and all("neither a kernel of dvidshards nor a module" in e for e in out["errors"])


_DEFAULT = textwrap.dedent("""
    import json, threading, numba
    from dvidshards.formats import jit
    jit.install_compiler(jit.Compiler())  # what formats does with no runtime installed
    k = jit.kernel(numba.njit(cache=False)(lambda a, b: a + b), [(numba.int64, numba.int64)], lambda a, b: -(a + b))
    print(json.dumps({"first": k(1, 2), "threads": threading.active_count(), "status": jit.status(),
                      "wait": jit.wait(0)}))
""")


def test_without_a_runtime_a_kernel_compiles_in_the_callers_thread_at_its_first_call(tmp_path):
    env = _mods(tmp_path)
    r = subprocess.run([sys.executable, "-c", _DEFAULT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["first"] == 3 and out["threads"] == 1 and out["wait"] is True, out
    assert set(out["status"].values()) == {"compiled"}, out


_WARM = textwrap.dedent("""
    import argparse, sys
    from dvidshards.runtime import kernels
    p = argparse.ArgumentParser()
    kernels.add_arguments(p)
    sys.exit(kernels.main(p.parse_args(sys.argv[1:])))
""")

_LOAD_TWO = textwrap.dedent("""
    import json
    from dvidshards.formats import jit
    from dvidshards.runtime import kernels as rk
    import twokernels as m
    out = {"cached": [rk.in_cache(m.twice), rk.in_cache(m.thrice)]}
    rk.prepare_for_job("twokernels")
    d = [m.twice.dispatcher, m.thrice.dispatcher]
    out["misses"] = sum(sum(x._cache_misses.values()) for x in d)
    out["hits"] = sum(sum(x._cache_hits.values()) for x in d)
    print(json.dumps(out))
""")


@pytest.mark.slow  # child processes that compile
def test_warm_fills_the_cache_in_two_processes_and_check_says_so(tmp_path):
    env = _mods(tmp_path)

    def warm(*args):
        return subprocess.run([sys.executable, "-c", _WARM, *args], capture_output=True, text=True, env=env,
                              timeout=600, cwd=str(tmp_path))

    r = warm("--check", "twokernels")
    assert r.returncode == 1 and "not in the cache: twokernels._twice" in r.stdout, r.stdout + r.stderr
    r = warm("-j", "2", "twokernels")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 kernels ready in numba's cache" in r.stdout and str(tmp_path / "numba") in r.stdout, r.stdout
    assert warm("--check", "twokernels").returncode == 0
    r = subprocess.run([sys.executable, "-c", _LOAD_TWO], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"cached": [True, True], "misses": 0, "hits": 2}
    r = warm("no.such.module")
    assert r.returncode != 0 and "neither a kernel of dvidshards nor a module" in r.stderr


def test_import_dvidshards_installs_the_runtime():
    """``import dvidshards`` alone installs the kernel compiler, the mapping file cache and the
    fork guard of ``dvidshards.runtime`` (formats imports nothing above it)."""
    code = textwrap.dedent("""
        import json, sys
        import dvidshards
        from dvidshards.formats import jit, mapping
        print(json.dumps([type(jit.installed_compiler()).__module__, type(mapping.installed_files()).__module__,
                          "dvidshards.runtime.forks" in sys.modules]))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == ["dvidshards.runtime.kernels", "dvidshards.runtime.mappings", True]


_WAITING = textwrap.dedent("""
    import json, sys
    import numpy as np
    from dvidshards.formats import mapping
    from dvidshards.runtime import kernels as rk
    rk.prepare_for_job()  # job mode; a kernel another process compiles is waited for
    keys, values = np.array([1, 2], np.uint64), np.array([5, 6], np.uint64)
    out = np.zeros(3, np.uint64)
    print("calling", flush=True)
    mapping._apply_k(np.array([1, 2, 3], np.uint64), keys, values, out)
    d = mapping._apply_k.dispatcher
    print(json.dumps({"got": out.tolist(), "ready": mapping._apply_k.ready, "misses": sum(d._cache_misses.values()),
                      "threads": [t.name for t in __import__("threading").enumerate()]}), flush=True)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX: flock")
def test_a_job_waits_for_the_process_compiling_a_kernel_then_runs_it_compiled(tmp_path, monkeypatch):
    """The default (prepare_for_job(wait=True)): the first call of a kernel another process holds
    waits for that process (no fallback work beside its compile), then runs the compiled code."""
    import fcntl
    import select

    from dvidshards.formats import mapping

    env = _mods(tmp_path)
    monkeypatch.setenv("NUMBA_CACHE_DIR", env["NUMBA_CACHE_DIR"])
    with open(rk._kernel_lock_path(mapping._apply_k), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        p = subprocess.Popen([sys.executable, "-c", _WAITING], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env, cwd=str(tmp_path))
        try:
            assert p.stdout is not None
            assert p.stdout.readline().strip() == "calling"
            answered = select.select([p.stdout], [], [], 2.0)[0]  # nothing while the lock is held
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    stdout, stderr = p.communicate(timeout=600)
    assert not answered and p.returncode == 0, stderr
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["got"] == [5, 6, 3] and out["ready"] and out["misses"] == 1, out
    assert not any(t.startswith("dvidshards-kernels") for t in out["threads"]), out  # no thread, no helper
