"""Command line: ``dvidshards info | demo | verify | consolidate``."""

from __future__ import annotations

import argparse
import sys

from .errors import DvidShardsError

__all__ = ["main"]


def _count_chunks(ds, scale, stems) -> tuple[int, str]:
    """Chunks listed by a scale's indexes and the index variant(s) seen."""
    from .dataset import open_shard
    from .index import parse_csv

    src, total, variants = ds.source, 0, set()
    for o in stems:
        stem = f"{scale.folder}/{o[0]}_{o[1]}_{o[2]}"
        if src.exists(stem + ".csv"):
            raw = parse_csv(src.read(stem + ".csv"), src.describe(stem + ".csv"))
            total += len(raw.coords)
            variants.add(raw.variant)
        else:
            sf = open_shard(src, stem, scale.chunk_size)
            total += len(sf)
            variants.add(sf.index.variant)
    return total, "/".join(sorted(variants)) or "-"


def cmd_info(args) -> int:
    from .dataset import SINGLE_SHARD, Dataset

    ds = Dataset(args.source, spec=args.spec)
    print(f"{ds.source.describe('')}  ({'geometry inferred from files' if ds.spec is None else 'geometry from spec'})")
    head = f"{'scale':>5} {'key':>10} {'size (x,y,z)':>22} {'resolution':>16} {'shard':>6} {'shards':>7}"
    print(head + ("" if args.no_chunks else f" {'chunks':>10} {'of grid':>8} index"))
    for s in ds.scales:
        stems = ds.shards(s.index)
        res = "x".join(f"{r:g}" for r in s.resolution)
        extent = s.shard_extent if s.shard_extent < SINGLE_SHARD else "all"
        line = (f"{s.index:>5} {s.key:>10} {'x'.join(map(str, s.size)):>22} {res:>16} {extent!s:>6} "
                f"{len(stems):>7}")
        if not args.no_chunks:
            n, variant = _count_chunks(ds, s, stems)
            line += f" {n:>10} {n / s.num_chunk_slots:>8.1%} {variant}"
        print(line)
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    run_demo(args.out, size=tuple(args.size), seed=args.seed, png=args.png)
    return 0


def cmd_verify(args) -> int:
    from .verify import verify

    report = verify(args.source, scale=args.scale, decode=args.decode, spec=args.spec, progress=not args.quiet)
    print(report.summary())
    return 0 if report.ok else 1


def cmd_consolidate(args) -> int:
    from .dataset import Dataset
    from .index import write_consolidated

    ds = Dataset(args.source, spec=args.spec)
    scales = ds.scales if args.scale is None else [ds.scale(args.scale)]
    for s in scales:
        path, n, shards = write_consolidated(ds, s, args.out)
        print(f"{s.folder}: {n} chunks in {shards} shards -> {path}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="dvidshards", description="Read DVID export-shards exports.")
    sub = p.add_subparsers(dest="cmd", required=True)

    def with_source(sp):
        sp.add_argument("source", help="export root (directory, gs://, s3://, http(s):// URL)")
        sp.add_argument("--spec", help="the neuroglancer multiscale spec given to DVID (default: ./info or inferred)")

    sp = sub.add_parser("info", help="scales, sizes, resolution, shard and chunk counts, index variant")
    with_source(sp)
    sp.add_argument("--no-chunks", action="store_true", help="skip counting chunks (reads every index)")
    sp.set_defaults(func=cmd_info)

    sp = sub.add_parser("demo", help="write a synthetic export, read it back, save a PNG slice")
    sp.add_argument("--out", help="output folder (default: a new temporary folder)")
    sp.add_argument("--size", type=int, nargs=3, default=[512, 448, 256], metavar=("X", "Y", "Z"))
    sp.add_argument("--seed", type=int, default=7)
    sp.add_argument("--png", help="where to save the slice picture")
    sp.set_defaults(func=cmd_demo)

    sp = sub.add_parser("verify", help="check an export end to end; exit 1 on problems")
    with_source(sp)
    sp.add_argument("--scale", type=int, help="only this scale")
    sp.add_argument("--decode", action="store_true", help="also decompress and decode every block")
    sp.add_argument("--quiet", action="store_true", help="no progress bar")
    sp.set_defaults(func=cmd_verify)

    sp = sub.add_parser("consolidate", help="write one chunk index file per scale for instant opening")
    with_source(sp)
    sp.add_argument("--scale", type=int, help="only this scale")
    sp.add_argument("--out", required=True, help="folder for the index files (never inside the export)")
    sp.set_defaults(func=cmd_consolidate)

    args = p.parse_args(argv)
    try:
        return args.func(args)
    except DvidShardsError as e:
        print(f"dvidshards: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
