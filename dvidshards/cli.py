"""The ``dvidshards`` command line.

Every command is one row of `COMMANDS`: its name, the object that implements it (``"module"``
or ``"module:attribute"``, imported only when the command runs) and a one-line help. The
object exposes ``add_arguments(parser)`` and ``main(args) -> int``.

Exit codes: 0 success; 1 problems found (``verify``, a job that did not complete: ``JobError``);
2 bad input or usage. A user error (any
`DvidShardsError`, an ``OSError`` on a path, a bad argument) prints one line on stderr, never a
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
import threading
import warnings

from .errors import DvidShardsError, JobError, SpecError

__all__ = ["COMMANDS", "build_parser", "main"]

#: command name -> (implementation "module[:attribute]", one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("dvidshards.cli:Info", "scales, sizes, resolution, shard and chunk counts, index variants"),
    "verify": ("dvidshards.jobs.verify:VerifyCommand", "check an export end to end; exit 1 when problems are found"),
    "consolidate": ("dvidshards.cli:Consolidate",
                    "write one chunk index per scale outside the export, so that it opens at once"),
    "demo": ("dvidshards.cli:Demo", "write a synthetic export, read it back, check it and draw a slice"),
    "convert": ("dvidshards.jobs.convert:ConvertCommand",
                "convert an export to neuroglancer precomputed or zarr v3: every scale of the spec (the ones an export "
                "lacks are made the way DVID makes its pyramid)"),
    "stats": ("dvidshards.jobs.stats:StatsCommand",
              "per-body voxels, supervoxels, chunks and bounding box of a scale, one task per shard"),
    "label-index": ("dvidshards.jobs.labelindex:LabelIndexCommand",
                    "write the label index (body, supervoxel, chunk, voxels) as a Parquet dataset"),
    "body": ("dvidshards.cli:BodyCommand",
             "one body: size, box, supervoxels, DVID sparsevol (and -coarse) bytes, its mesh as .ply/.obj, its "
             "skeleton as .swc"),
    "meshes": ("dvidshards.jobs.meshes:MeshesCommand",
               "neuroglancer multi-resolution (or legacy) meshes of every body into a precomputed dataset, one task "
               "per shard"),
    "skeletons": ("dvidshards.jobs.skeletons:SkeletonsCommand",
                  "skeletons of every body (kimimaro on blocks, one tree per connected piece, nm) as sharded "
                  "precomputed and/or SWC"),
    "downsample": ("dvidshards.jobs.downsample:DownsampleCommand",
                   "make the scales an export lacks the way DVID makes its pyramid (a DVID export beside it)"),
    "pcg-edges": ("dvidshards.jobs.pcg:PcgEdgesCommand",
                  "PyChunkedGraph edges and components files of the supervoxels, one task per PCG chunk"),
    "view": ("dvidshards.serve.view",
             "serve an export as a neuroglancer precomputed source and open a viewer on it"),
    "serve-flight": ("dvidshards.serve.flight:FlightCommand", "serve an export's (or a table's) block records over Arrow Flight"),
    "warm": ("dvidshards.runtime.kernels:WarmCommand",
             "compile every numba kernel into numba's cache ahead of time (images, containers); --check tests it"),
    "serve-dvid": ("dvidshards.serve.dvid:DvidCommand", "answer DVID's read-only labelmap HTTP API from an export"),
    "ingest": ("dvidshards.jobs.ingest:IngestCommand",
               "pull block records from a Flight server or an export into a sorted Parquet table, or turn "
               "DVID /blocks dumps into an export"),
}

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A bad command line (raised instead of argparse's exit)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block, no exit
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def _load(target: str):
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attr) if attr else obj


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; only ``command``'s implementation is imported for its options."""
    from .jobs.output import package_version

    p = _Parser(prog="dvidshards", description="Read, check and index DVID export-shards exports.",
                epilog="Run 'dvidshards COMMAND --help' for a command's options.")
    p.add_argument("--version", action="version", version=f"dvidshards {package_version()}",
                   help="print the version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, (target, text) in COMMANDS.items():
        sp = sub.add_parser(name, help=text, description=text)
        if name == command:
            _load(target).add_arguments(sp)
    return p


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and not isinstance(e, DvidShardsError) and e.strerror:
        where = f"{e.filename}: " if e.filename is not None else ""
        text = f"{where}{e.strerror}"
    else:
        text = str(e) or type(e).__name__
    return " ".join(text.split())


def _warning_line(prog: str):
    def show(message, category, filename, lineno, file=None, line=None):
        print(f"{prog}: warning: {' '.join(str(message).split())}", file=sys.stderr)

    return show


#: a line of the C++ libraries' own logs (absl/glog in TensorStore, the AWS SDK): ``E1126 17:50:33.93 14838 f.cc:188] ...``
_NATIVE_LOG = re.compile(rb"^[IWEF][0-9]{4} [0-9:.]+ +[0-9]+ [^\]\s]+:[0-9]+\] ")


class _NativeLogs:
    """While a command runs, drop the lines TensorStore's C++ libraries log on file descriptor 2
    (credential searches, retries: a bucket that cannot be reached prints one dvidshards line, not
    ten of theirs). ``DVIDSHARDS_NATIVE_LOGS=1`` keeps them. Everything else passes through at once
    (progress bars included)."""

    def __enter__(self) -> _NativeLogs:
        self.saved: int | None = None
        if os.environ.get("DVIDSHARDS_NATIVE_LOGS", "").strip() not in ("", "0"):
            return self
        try:
            sys.stderr.flush()
            saved = os.dup(2)
            r, w = os.pipe()
            os.dup2(w, 2)
            os.close(w)
        except OSError:  # no file descriptor 2 to take over: leave it alone
            return self
        self.saved, self.r = saved, r
        self.thread = threading.Thread(target=self._pump, name="dvidshards-stderr", daemon=True)
        self.thread.start()
        return self

    def _pump(self) -> None:
        # The pump owns the pipe's read end and the saved stderr and closes both when the pipe
        # ends: a child process still holding the pipe can outlive the command, and a number
        # closed by the command could meanwhile be another file's (written to by mistake).
        buf = b""
        try:
            while True:
                try:
                    chunk = os.read(self.r, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                buf += chunk
                *lines, buf = buf.split(b"\n")
                out = b"".join(line + b"\n" for line in lines if not _NATIVE_LOG.match(line))
                if buf and not (buf[:1] in b"IWEF" and len(buf) < 96):  # cannot be the start of a log line
                    out, buf = out + buf, b""
                if out:
                    self._write(out)
            if buf and not _NATIVE_LOG.match(buf):
                self._write(buf)
        finally:
            assert self.saved is not None
            os.close(self.r)
            os.close(self.saved)

    def _write(self, data: bytes) -> None:
        assert self.saved is not None
        try:
            os.write(self.saved, data)
        except OSError:
            pass

    def __exit__(self, *exc) -> None:
        if self.saved is None:
            return
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(self.saved, 2)  # closes this process's write end of the pipe
        self.thread.join(timeout=1.0)  # a child still holding the pipe must not hold the command


def main(argv=None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 problems found, 2 bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    command = command if command in COMMANDS else None
    try:
        parser = build_parser(command)
        if not argv:
            parser.print_help()
            return EXIT_OK
        args = parser.parse_args(argv)
        if args.command is None:
            raise UsageError(f"dvidshards: give a command, one of {', '.join(COMMANDS)} "
                             f"(see dvidshards --help)")
    except UsageError as e:
        print(str(e), file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else EXIT_OK
    prog = f"dvidshards {args.command}"
    try:
        with warnings.catch_warnings(), _NativeLogs():
            warnings.showwarning = _warning_line(prog)
            return int(_load(COMMANDS[args.command][0]).main(args))
    except UsageError as e:
        text = _one_line(e)
        print(text if text.startswith(prog) else f"{prog}: {text}", file=sys.stderr)
    except JobError as e:  # the job ran and did not complete: its summary says what to do
        summary = getattr(e.report, "summary", None)
        if callable(summary):
            print(summary(), file=sys.stderr)
        else:
            print(f"{prog}: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return EXIT_PROBLEMS
    except DvidShardsError as e:
        print(f"{prog}: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
    except OSError as e:
        print(f"{prog}: {_one_line(e)}", file=sys.stderr)
    except KeyboardInterrupt as e:  # a job's frame has said what is incomplete and how to finish it
        notes = getattr(e, "__notes__", None)
        if not notes:
            print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return EXIT_USAGE


# --------------------------------------------------------------------------- shared checks


def progress_wanted(args) -> bool:
    """Progress bars only on a terminal, and never with --quiet."""
    return not getattr(args, "quiet", False) and sys.stderr.isatty()


def output_folder(path: str, what: str = "--out", create: bool = True) -> str:
    """Check before any work that ``path`` is, or can be made, a writable folder (and make it)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{what} {path}: exists and is not a folder")
    if not create:
        up = os.path.abspath(path)
        while not os.path.exists(up):
            up = os.path.dirname(up)
        if not os.path.isdir(up) or not os.access(up, os.W_OK | os.X_OK):
            raise UsageError(f"{what} {path}: cannot create or write the folder here ({up} is not writable)")
        return path
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{what} {path}: cannot create the folder ({e.strerror or e})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"{what} {path}: the folder is not writable")
    return path


def output_file(path: str, what: str, suffix: str | tuple[str, ...] = ()) -> str:
    """Check before any work that a file can be written at ``path`` (its folder exists, writable)."""
    suffixes = (suffix,) if isinstance(suffix, str) else suffix
    if suffixes and not path.lower().endswith(suffixes):
        raise UsageError(f"{what} {path}: the file name must end in {' or '.join(suffixes)}")
    if os.path.isdir(path):
        raise UsageError(f"{what} {path}: is a folder; give a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{what} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"{what} {path}: not writable")
    return path


def _source_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="export root: a folder, gs://, s3://, http(s):// URL or kvstore JSON")
    p.add_argument("--spec", help="the neuroglancer multiscale spec given to DVID's export-shards (JSON file); "
                                  "default: the export's info file, else geometry inferred from the files")


# --------------------------------------------------------------------------- commands
# Thin adapters onto the library: the calls into dataset, verify and consolidated live here only.


class Info:
    """``dvidshards info``."""

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        _source_arguments(p)
        p.add_argument("--no-chunks", action="store_true",
                       help="skip counting chunks (counting reads every shard's index)")

    @staticmethod
    def main(args) -> int:
        import warnings

        from .dataset import Dataset, LayeredStore
        from .errors import GeometryWarning
        from .formats.multiscale import SINGLE_SHARD
        from .scalefiles import not_exported_note, scales_phrase

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GeometryWarning)  # said in the table instead
            ds = Dataset(args.source, spec=args.spec)
        origin = "geometry from spec" if ds.spec is not None else "geometry INFERRED from file names (pass --spec)"
        print(f"{ds.store.describe('')}  ({origin})")
        if isinstance(ds.store, LayeredStore):  # several roots: where each scale comes from
            for i, root in enumerate(ds.store.stores):
                ks = [k for k, r in ds.store.route.items() if r == i]
                print(f"  {scales_phrase(ks)} from {root.describe('')}")
        head = ["scale", "key", "size (x,y,z)", "resolution", "shard", "naming", "shards"]
        if not args.no_chunks:
            head += ["chunks", "of grid", "index"]
        rows = []
        for s in ds.scales:
            res = "x".join(f"{r:g}" for r in s.resolution) if s.resolution is not None else "unknown"
            if s.index not in ds.exported:  # a scale the spec lists and the export lacks: said, not counted
                rows.append([str(s.index), s.key, "x".join(map(str, s.size)), res, "-", "-", "not exported"]
                            + ([] if args.no_chunks else ["-", "-", "-"]))
                continue
            origins = ds.shards(s.index)  # listed and checked (names against the grid of the scale's naming)
            extent = s.shard_extent if s.shard_extent < SINGLE_SHARD else "all"
            mark = "*" if s.inferred else ""
            naming = "?" if "shard_extent" in s.inferred else s.naming if s.namings_differ else "either"
            row = [str(s.index), s.key, "x".join(map(str, s.size)) + mark, res, f"{extent}{mark}", naming,
                   str(len(origins))]
            if not args.no_chunks:
                n, variants = 0, set()
                for o in origins:
                    shard = ds.shard(s.index, o, policy="lazy")
                    n += len(shard)
                    variants.add(shard.variant)
                row += [str(n), f"{n / s.num_chunk_slots:.1%}", "/".join(sorted(variants)) or "-"]
            rows.append(row)
        # columns as wide as their longest cell (the mCNS keys reach 17 characters)
        width = [max(len(r[k]) for r in [head, *rows]) for k in range(len(head))]
        for r in [head, *rows]:
            print(" ".join(c.ljust(w) if head[k] == "index" else c.rjust(w)
                           for k, (c, w) in enumerate(zip(r, width, strict=True))).rstrip())
        absent = [s.index for s in ds.scales if s.index not in ds.exported]
        if absent:
            print(not_exported_note(ds.store, absent))
        if any(s.naming == "old" for s in ds.scales):
            print("naming old: shard files named as DVID did before 2026-03-21 (one cube per scale: a neuroglancer "
                  "shard can span several files); current: as DVID names them since; either: both name them alike")
        if any(s.inferred for s in ds.scales):
            print("* inferred from the files, not given by a spec")
        return EXIT_OK


class Consolidate:
    """``dvidshards consolidate``."""

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        _source_arguments(p)
        p.add_argument("--scale", type=int, metavar="K", help="only scale K (folder sK); default: every scale")
        p.add_argument("--out", required=True, metavar="FOLDER",
                       help="folder for the index files (created if needed; never inside the export)")
        p.add_argument("--quiet", action="store_true", help="no progress bar")

    @staticmethod
    def main(args) -> int:
        from .consolidated import write_consolidated
        from .dataset import Dataset

        output_folder(args.out, create=False)  # made by write_consolidated, never inside the export
        ds = Dataset(args.source, spec=args.spec)
        if args.scale is None:  # every scale the export holds; the spec's others are said
            scales = [s for s in ds.scales if s.index in ds.exported]
        else:
            scales = [ds.require_scale(args.scale)]
        if not scales:
            raise UsageError(f"dvidshards consolidate: {args.source} holds no scale folder s0, s1, ...")
        for s in scales:  # every scale checked (folder, spec against the file names) before any is written
            ds.shards(s.index)
        for s in scales:
            path, n, shards = write_consolidated(ds, s, args.out, progress=progress_wanted(args))
            print(f"{s.folder}: {n} chunks in {shards} shards -> {path}")
        absent = [s.index for s in ds.scales if s.index not in ds.exported]
        if args.scale is None and absent:
            from .scalefiles import not_exported_note

            print(not_exported_note(ds.store, absent))
        return EXIT_OK


class BodyCommand:
    """``dvidshards body EXPORT ID [--size] [--box] [--supervoxels] [--sparsevol F] [--coarse F]
    [--mesh F.ply|F.obj] [--skeleton F.swc]``: one JSON line of facts, the files written."""

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        _source_arguments(p)
        p.add_argument("id", type=int, help="body id (a supervoxel id with --labels supervoxels)")
        p.add_argument("--scale", type=int, default=0, metavar="K", help="scale K (folder sK); default 0")
        p.add_argument("--labels", default="agglomerated",
                       help="agglomerated (default), supervoxels, or a supervoxel->body mapping file")
        p.add_argument("--index", metavar="FOLDER", help="a label index (dvidshards label-index) to find the chunks")
        p.add_argument("--size", action="store_true", help="print the body's voxel count")
        p.add_argument("--box", action="store_true", help="print the body's exact voxel box")
        p.add_argument("--supervoxels", action="store_true", help="print the body's supervoxel ids")
        p.add_argument("--sparsevol", metavar="FILE", help="write DVID's sparsevol RLE bytes")
        p.add_argument("--coarse", metavar="FILE", help="write DVID's sparsevol-coarse RLE bytes")
        p.add_argument("--mesh", metavar="FILE", help="write the body's mesh (nm) as .ply or .obj")
        p.add_argument("--mesh-scale", type=int, default=None, metavar="K", help="scale to mesh (default: --scale)")
        p.add_argument("--skeleton", metavar="FILE",
                       help="write the body's skeleton as FlyEM's SWC (scale-0 voxels, radii in nm; needs "
                            "dvidshards[skeleton])")
        p.add_argument("--skeleton-scale", type=int, default=None, metavar="K",
                       help="scale to skeletonize (default: the finest of at least 32 nm, as dvidshards skeletons)")

    @staticmethod
    def main(args) -> int:
        from .bodies import Body
        from .dataset import Dataset
        from .formats.mesh import to_obj, to_ply
        from .formats.skeleton import need_kimimaro
        from .stores import as_store

        def write(path: str, data: bytes) -> None:
            folder, name = os.path.split(os.path.abspath(path))
            with as_store(folder, writable=True).writer(name) as f:
                f.write(data)

        for path, what, suffix in ((args.sparsevol, "--sparsevol", ()), (args.coarse, "--coarse", ()),
                                   (args.mesh, "--mesh", (".ply", ".obj")), (args.skeleton, "--skeleton", ".swc")):
            if path is not None:  # every check before any work
                output_file(path, what, suffix)
        if args.skeleton:
            need_kimimaro()
        body = Body(Dataset(args.source, spec=args.spec), args.id, scale=args.scale, labels=args.labels,
                    index=args.index)
        if not body.exists():  # one line saying what the id is instead (exit 2, as any bad input)
            raise body.not_found()
        facts: dict = {"id": body.id, "scale": body.scale, "chunks": int(len(body.chunks()))}
        asked = args.size or args.box or args.supervoxels or args.sparsevol or args.coarse or args.mesh or args.skeleton
        if args.size or not asked:
            facts["size"] = body.size()
        if args.box or not asked:
            facts["box"] = body.box()
        if args.supervoxels:
            facts["supervoxels"] = body.supervoxels().tolist()
        if args.sparsevol:
            write(args.sparsevol, body.sparsevol())
            facts["sparsevol"] = args.sparsevol
        if args.coarse:
            write(args.coarse, body.sparsevol_coarse())
            facts["coarse"] = args.coarse
        if args.mesh:
            m = body.mesh(args.mesh_scale)
            write(args.mesh, to_ply(m) if args.mesh.lower().endswith(".ply") else to_obj(m))
            facts["mesh"] = {"file": args.mesh, "vertices": len(m.vertices), "faces": len(m.faces)}
        if args.skeleton:
            sk = body.skeleton(scale=args.skeleton_scale)
            write(args.skeleton, sk.swc(header=[f"body {body.id} of {body.ds.store.describe('')}, by dvidshards body "
                                                 f"(kimimaro)"]).encode())
            facts["skeleton"] = {"file": args.skeleton, "vertices": len(sk.vertices), "trees": sk.trees}
        print(json.dumps(facts))
        return EXIT_OK


class Demo:
    """``dvidshards demo``."""

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        from .demo import DEFAULT_SIZE

        p.add_argument("--out", metavar="FOLDER",
                       help="keep the export in this folder (default: a temporary folder, removed at the end)")
        p.add_argument("--size", type=int, nargs=3, default=list(DEFAULT_SIZE), metavar=("X", "Y", "Z"),
                       help=f"volume size in voxels (default {' '.join(map(str, DEFAULT_SIZE))})")
        p.add_argument("--seed", type=int, default=7, help="random seed of the synthetic neurons (default 7)")
        p.add_argument("--png", metavar="FILE",
                       help="where to save the picture (default: dvidshards-demo.png in the --out folder, "
                            "else in the current folder)")

    @staticmethod
    def main(args) -> int:
        from .demo import check_size, run_demo

        try:
            size = check_size(args.size)
        except SpecError as e:
            raise UsageError(f"dvidshards demo: --size {' '.join(map(str, args.size))}: {e}") from None
        # every check before any work: nothing is created when an argument is bad
        if args.out is not None:
            output_folder(args.out, create=False)
        if args.png is not None:
            output_file(args.png, "--png", ".png")
        elif args.out is None:
            output_file("dvidshards-demo.png", "the picture (--png)", ".png")
        png = args.png or os.path.join(args.out or os.curdir, "dvidshards-demo.png")
        if args.out is not None:
            output_folder(args.out)
        result = run_demo(args.out, size=size, seed=args.seed, png=png)
        return EXIT_OK if result["exact"] else EXIT_PROBLEMS


if __name__ == "__main__":
    sys.exit(main())
