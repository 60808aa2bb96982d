"""Fuzz the DVID block decoder with mutated real blocks, in child processes.

Run from the project root::

    python benchmarks/fuzz_blocks.py [--n 1000000] [--seed 1] [--jobs 2] [--data DIR]

Each child process decodes a chunk of cases (case i of a run is fully determined by
``(seed, i)``) through ``decode_into`` / ``decode_block`` / ``block_header`` with assorted
palettes and output views. A case must either decode or raise ``BlockDecodeError``; any other
exception is counted as an error, and a child that dies (a signal, e.g. SIGSEGV) is counted
as a crash, reported with the case it was running (``--repro SEED:INDEX`` replays one case).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dvidshards.errors import BlockDecodeError  # noqa: E402
from dvidshards.formats.codec import block_header, decode_block, decode_into  # noqa: E402

REAL_SHARD = "30720_24576_28672.arrow"
MAX_ALLOC_VOXELS = 1 << 22  # decode_block(out=None) only for declared shapes up to this


def load_sources(data_dir: Path) -> tuple[list[bytes], list[np.ndarray | None]]:
    """Valid seed blocks (258 real mCNS blocks + fib19) and their agglomerated palettes."""
    import pyarrow as pa
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    blocks, palettes = [], []
    with pa.OSFile(str(data_dir / REAL_SHARD)) as f:
        for batch in pa.ipc.open_stream(f):
            d = batch.to_pydict()
            for payload, labels in zip(d["dvid_compressed_block"], d["labels"], strict=True):
                blocks.append(dctx.decompress(payload))
                palettes.append(np.asarray(labels, np.uint64))
    blocks.append(gzip.decompress((data_dir / "fib19-64x64x64-sample1-block.dat.gz").read_bytes()))
    palettes.append(None)
    return blocks, palettes


def _u32(v: int) -> bytes:
    return int(v % 2**32).to_bytes(4, "little")


def mutate(rng: np.random.Generator, blocks: list[bytes], k: int) -> bytes:
    """One to three random corruptions of blocks[k]."""
    b = bytearray(blocks[k])
    h = block_header(blocks[k])
    nsub = int(np.prod(h.grid))
    p_nsb = 16 + 8 * h.num_labels
    p_idx = p_nsb + 2 * nsub
    for _ in range(int(rng.integers(1, 4))):
        if not b:
            break
        kind = int(rng.integers(0, 12))
        n = len(b)
        if kind == 0:  # truncate
            del b[int(rng.integers(0, n)) :]
        elif kind == 1:  # bit flips
            for _ in range(int(rng.integers(1, 9))):
                i = int(rng.integers(0, n))
                b[i] ^= 1 << int(rng.integers(0, 8))
        elif kind == 2:  # header field
            field = int(rng.integers(0, 4))
            choices = [
                0,
                1,
                2,
                3,
                7,
                8,
                9,
                16,
                127,
                128,
                129,
                255,
                256,
                2**16,
                2**31,
                2**32 - 1,
                h.num_labels - 1,
                h.num_labels + 1,
                h.num_labels * 2,
            ]
            if n >= 16:
                b[4 * field : 4 * field + 4] = _u32(int(rng.choice(choices)))
        elif kind == 3 and p_idx <= n:  # sub-block label counts
            for _ in range(int(rng.integers(1, 5))):
                i = int(rng.integers(0, nsub))
                v = int(
                    rng.choice([0, 1, 2, 3, 4, 5, 8, 9, 255, 256, 257, 511, 512, 513, 1024, 65535])
                )
                b[p_nsb + 2 * i : p_nsb + 2 * i + 2] = v.to_bytes(2, "little")
        elif kind == 4 and p_idx < n:  # sub-block label indices
            for _ in range(int(rng.integers(1, 5))):
                i = p_idx + 4 * int(rng.integers(0, max(1, (min(n, h.nbytes) - p_idx) // 4)))
                v = int(
                    rng.choice(
                        [
                            0,
                            h.num_labels - 1,
                            h.num_labels,
                            h.num_labels + 1,
                            2**16,
                            2**31,
                            2**32 - 1,
                        ]
                    )
                )
                b[i : i + 4] = _u32(v)
        elif kind == 5:  # random bytes over a region
            i = int(rng.integers(0, n))
            m = int(rng.integers(1, 65))
            b[i : i + m] = rng.integers(0, 256, size=len(b[i : i + m]), dtype=np.uint8).tobytes()
        elif kind == 6:  # append garbage
            b += rng.integers(0, 256, size=int(rng.integers(1, 1000)), dtype=np.uint8).tobytes()
        elif kind == 7:  # delete a span
            i = int(rng.integers(0, n))
            del b[i : i + int(rng.integers(1, 200))]
        elif kind == 8:  # insert a span
            i = int(rng.integers(0, n))
            b[i:i] = rng.integers(0, 256, size=int(rng.integers(1, 64)), dtype=np.uint8).tobytes()
        elif kind == 9:  # splice with another block
            other = blocks[int(rng.integers(0, len(blocks)))]
            i = int(rng.integers(0, n))
            j = int(rng.integers(0, len(other)))
            b = b[:i] + bytearray(other[j:])
        elif kind == 10:  # all-ones packed values (values >= nsb)
            i = int(rng.integers(min(n - 1, h.nbytes // 2), n))
            b[i : i + 16] = b"\xff" * len(b[i : i + 16])
        else:  # zero a span
            i = int(rng.integers(0, n))
            m = int(rng.integers(1, 256))
            b[i : i + m] = bytes(len(b[i : i + m]))
    return bytes(b)


def make_outs() -> list[np.ndarray]:
    """Output arrays of assorted layouts for 64³ blocks (and smaller crops)."""
    return [
        np.empty((64, 64, 64), np.uint64),
        np.empty((64, 64, 64), np.uint64, order="F"),
        np.empty((64, 64, 128), np.uint64)[:, :, ::2],
        np.empty((64, 40, 23), np.uint64),
        np.empty((64, 64, 64), np.uint64).transpose(2, 1, 0),
        np.empty((8, 8, 8), np.uint64),
        np.empty((130, 64, 64), np.uint64)[1:129:2, ::-1],
        np.empty((0, 64, 64), np.uint64),
    ]


def run_case(rng, blocks, palettes, outs, k) -> str:
    """Decode one mutated case; returns 'decoded' or 'rejected' (other exceptions propagate)."""
    data = mutate(rng, blocks, k)
    arr = np.frombuffer(data, np.uint8)
    mode = int(rng.integers(0, 6))
    try:
        if mode == 0:  # the block's own label list
            decode_into(arr, None, outs[int(rng.integers(0, len(outs)))])
        elif mode == 1:  # its agglomerated palette (may no longer match N)
            pal = palettes[k]
            decode_into(arr, pal, outs[int(rng.integers(0, len(outs)))])
        elif mode == 2:  # palette of the declared length
            n = int.from_bytes(data[12:16], "little") if len(data) >= 16 else 0
            pal = np.arange(min(n, 1 << 20), dtype=np.uint64)
            decode_into(arr, pal, outs[0])
        elif mode == 3:  # block_header, then decode_block with an allocated output if small
            h = block_header(data)
            assert h.nbytes <= len(data) and h.labels.size == h.num_labels
            if int(np.prod(h.shape)) <= MAX_ALLOC_VOXELS:
                got = decode_block(data)
                assert got.shape == h.shape
        elif mode == 4:  # bytes-like input path with an explicit out
            decode_block(bytearray(data), out=outs[int(rng.integers(0, len(outs)))])
        else:  # a bigger-than-needed buffer sliced to the declared shape
            if len(data) >= 12:
                gx, gy, gz = (int.from_bytes(data[i : i + 4], "little") for i in (0, 4, 8))
                if 0 < gx * gy * gz * 512 <= MAX_ALLOC_VOXELS:
                    out = np.empty((8 * gz + 1, 8 * gy, 8 * gx + 3), np.uint64)[1:, :, 3:]
                    decode_into(arr, None, out)
                    return "decoded"
            decode_into(arr, None, outs[0])
        return "decoded"
    except BlockDecodeError:
        return "rejected"


def child(args) -> int:
    blocks, palettes = load_sources(args.data)
    outs = make_outs()
    state = np.memmap(args.state, dtype=np.int64, mode="r+", shape=(1,))
    counts = {"decoded": 0, "rejected": 0, "errors": 0}
    examples = []
    for i in range(args.start, args.start + args.count):
        state[0] = i  # survives a crash: the parent reads which case was running
        if i == args.crash_at:  # self-test of the crash detection
            os.kill(os.getpid(), signal.SIGSEGV)
        rng = np.random.default_rng([args.seed, i])
        k = int(rng.integers(0, len(blocks)))
        try:
            counts[run_case(rng, blocks, palettes, outs, k)] += 1
        except Exception:  # noqa: BLE001 - anything but BlockDecodeError is a bug
            counts["errors"] += 1
            if len(examples) < 5:
                examples.append(
                    {"case": f"{args.seed}:{i}", "error": traceback.format_exc(limit=3)}
                )
    print(json.dumps({"counts": counts, "examples": examples}))
    return 0


def repro(args) -> int:
    seed, i = (int(v) for v in args.repro.split(":"))
    blocks, palettes = load_sources(args.data)
    rng = np.random.default_rng([seed, i])
    k = int(rng.integers(0, len(blocks)))
    print(
        f"case {seed}:{i} from source block {k}:", run_case(rng, blocks, palettes, make_outs(), k)
    )
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="number of mutated cases")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="child processes at a time"
    )
    ap.add_argument("--chunk", type=int, default=25_000, help="cases per child process")
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "dvid")
    ap.add_argument("--repro", help="replay one case SEED:INDEX in this process")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--state", help=argparse.SUPPRESS)
    ap.add_argument(
        "--crash-at",
        type=int,
        default=-1,
        help="self-test: the child crashes (SIGSEGV) at this case",
    )
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    if args.repro:
        return repro(args)

    t0 = time.perf_counter()
    totals = {"decoded": 0, "rejected": 0, "errors": 0, "crashed": 0}
    problems: list[str] = []
    chunks = [(s, min(args.chunk, args.n - s)) for s in range(0, args.n, args.chunk)]
    decode_block(
        gzip.decompress((args.data / "fib19-64x64x64-sample1-block.dat.gz").read_bytes())
    )  # fill the JIT cache once

    with tempfile.TemporaryDirectory() as tmp:

        def run_chunk(chunk):
            start, count = chunk
            state = Path(tmp) / f"state-{start}"
            state.write_bytes(np.int64(-1).tobytes())
            cmd = [
                sys.executable,
                __file__,
                "--child",
                "--seed",
                str(args.seed),
                "--start",
                str(start),
                "--count",
                str(count),
                "--data",
                str(args.data),
                "--state",
                str(state),
                "--crash-at",
                str(args.crash_at),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            last = int(np.frombuffer(state.read_bytes(), np.int64)[0])
            return start, count, proc, last

        done = 0
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for start, count, proc, last in pool.map(run_chunk, chunks):
                if proc.returncode == 0:
                    res = json.loads(proc.stdout.strip().splitlines()[-1])
                    for key, v in res["counts"].items():
                        totals[key] += v
                    problems += [
                        f"error in case {e['case']}:\n{e['error']}" for e in res["examples"]
                    ]
                else:
                    # cases before the crashing one completed but their counts died with the child
                    totals["crashed"] += 1
                    sig = -proc.returncode
                    name = (
                        signal.Signals(sig).name if 0 < sig < 65 else f"exit code {proc.returncode}"
                    )
                    problems.append(
                        f"child {start}..{start + count} died ({name}) in case {args.seed}:{last}\n{proc.stderr[-2000:]}"
                    )
                done += count
                print(
                    f"  {done:>9,} / {args.n:,} cases, {time.perf_counter() - t0:7.1f} s",
                    file=sys.stderr,
                )

    for p in problems[:10]:
        print(p, file=sys.stderr)
    dt = time.perf_counter() - t0
    print(
        f"fuzz_blocks: n={args.n} seed={args.seed} decoded={totals['decoded']} rejected={totals['rejected']} "
        f"other_errors={totals['errors']} crashed={totals['crashed']} time={dt:.1f}s ({dt / max(args.n, 1) * 1e6:.0f} µs/case)"
    )
    return 0 if totals["errors"] == 0 and totals["crashed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
