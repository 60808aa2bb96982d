"""Fuzz whole exports (shard files and CSV indexes) through the public API, in worker processes.

Run from the project root::

    python benchmarks/fuzz_shards.py --shard-trials 5000 --csv-trials 2000 --seed 1 --jobs 2

Templates: the real mCNS shard (scale 1) with each of its three CSV indexes (variants A, B, C;
needs ``--data``) and synthetic exports written by ``dvidshards.writer`` (variants A with 1 and
3 rows per batch, B, C, C in an IPC file, D, and A opened without a spec). Every trial mutates one
region of one shard or index (see ``tests.support.fuzz``), reads every chunk in both label
modes, runs ``verify(decode=True)`` and is classified; a worker that dies or hangs is counted
and restarted. Prints one table per kind, the worker RSS over the run, and for every bad class
a few examples with their reproducer (``--repro KIND:SEED:TRIAL:TEMPLATE`` replays one trial in
this process and leaves the mutated export on disk). Inputs of bad trials are copied to the
failures folder printed at the end. Exit status 1 when a crash, hang, untyped error or
structural silent difference was seen.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.support import fuzz  # noqa: E402

DEFAULT_DATA = ROOT.parent / "shared" / "data" / "dvid"


def interleave(a: list, b: list) -> list:
    """Merge two request lists keeping each one's order, spread evenly (partial runs cover both)."""
    keyed = [((i + 0.5) / len(a), 0, r) for i, r in enumerate(a)] + [((i + 0.5) / len(b), 1, r)
                                                                       for i, r in enumerate(b)]
    return [r for _, _, r in sorted(keyed, key=lambda k: (k[0], k[1]))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shard-trials", type=int, default=5000)
    ap.add_argument("--csv-trials", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before a trial counts as a hang")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder of the real mCNS shard")
    ap.add_argument("--no-real", action="store_true", help="synthetic templates only")
    ap.add_argument("--no-synthetic", action="store_true", help="real templates only")
    ap.add_argument("--workdir", type=Path, default=None, help="templates and scratch (default: a temp dir)")
    ap.add_argument("--failures", type=Path, default=None, help="where bad inputs go (default: a temp dir)")
    ap.add_argument("--rss-cap-mb", type=int, default=4096, help="restart a worker above this RSS")
    ap.add_argument("--repro", metavar="KIND:SEED:TRIAL:TEMPLATE", help="replay one trial in this process")
    args = ap.parse_args(argv)

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dvidshards-fuzz-"))
    real = not args.no_real and (args.data / f"{fuzz.REAL_SHARD}.arrow").is_file()
    if not args.no_real and not real:
        print(f"real data not found in {args.data}: synthetic templates only", file=sys.stderr)
    t0 = time.perf_counter()
    if not (workdir / "templates").is_dir():
        fuzz.build_templates(workdir, args.data if real else None, synthetic=not args.no_synthetic, real=real)
    templates = fuzz.load_templates(workdir)
    if args.repro:
        return fuzz.main(["repro", "--workdir", str(workdir), args.repro])
    failures = args.failures or Path(tempfile.mkdtemp(prefix="dvidshards-fuzz-failures-"))
    print(f"templates: {', '.join(t.name for t in templates)} (built in {time.perf_counter() - t0:.0f} s, "
          f"{workdir})", file=sys.stderr)

    requests = interleave(fuzz.plan_requests(templates, "shard", args.shard_trials, args.seed),
                          fuzz.plan_requests(templates, "csv", args.csv_trials, args.seed))
    camp = fuzz.Campaign(workdir, jobs=args.jobs, timeout=args.timeout, failures=failures,
                         rss_cap=args.rss_cap_mb << 20)
    t1 = time.perf_counter()
    state = {"n": 0, "bad": 0, "last": t1}

    def progress(res):
        state["n"] += 1
        state["bad"] += res["class"] in fuzz.FAIL
        now = time.perf_counter()
        if now - state["last"] > 30 or state["n"] == len(requests):
            state["last"] = now
            rss = ", ".join(f"{s[-1][1] / 2**20:.0f}" for s in camp.rss.values())
            print(f"  {state['n']:>6}/{len(requests)} trials, {now - t1:7.0f} s, {state['bad']} bad, "
                  f"worker RSS MB: {rss}", file=sys.stderr, flush=True)

    camp.run(requests, progress)
    dt = time.perf_counter() - t1

    print(f"## fuzz_shards: seed {args.seed}, {args.shard_trials} shard + {args.csv_trials} CSV trials, "
          f"{args.jobs} workers, {dt:.0f} s ({dt / max(len(requests), 1) * args.jobs:.2f} s/trial/worker)\n")
    print(f"templates: {', '.join(t.name for t in templates)}\n")
    for kind in ("shard", "csv"):
        if any(r["kind"] == kind for r in camp.results):
            print(f"### {kind} trials\n\n{camp.table(kind)}\n")
    print(f"### worker RSS ({camp.restarts} restarts after crash/hang, {camp.rss_restarts} at the RSS cap)\n")
    print(camp.rss_table() + "\n")
    ex = camp.examples(fuzz.FAIL + ("verify_missed", "unnamed"))
    if ex:
        print("### bad trials (a few per class and region; verify_missed and unnamed are reported, not failures)\n")
        for e in ex:
            case = f"{e['kind']}:{e['seed']}:{e['trial']}:{e['template']}"
            print(f"- **{e['as']}** [{case}] {e.get('mutation')}\n  -> {e.get('detail')}")
            if e.get("stderr"):
                tail = [ln for ln in e["stderr"].splitlines() if ln.strip()][-8:]
                print("  " + "\n  ".join(tail))
        print(f"\nreplay one: python benchmarks/fuzz_shards.py --workdir {workdir} --repro KIND:SEED:TRIAL:TEMPLATE")
    camp.save(failures / "results.json")
    print(f"failing inputs, every result and the RSS series (results.json): {failures}")
    total = camp.counts()["total"] if camp.results else {}
    return 1 if any(total.get(c, 0) for c in fuzz.FAIL) else 0


if __name__ == "__main__":
    raise SystemExit(main())
