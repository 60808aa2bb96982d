"""Every job's output, from the user's side: stats,
label-index, pcg-edges and ingest stand on dvidshards.jobs.output.

* a bucket that cannot be reached (``gs://no-such-bucket/x`` without network) is refused in one
  line after a few attempts (not TensorStore's default 32 retries, up to 32 s apart), and no local
  folder is made;
* ``stats --out X --workdir X`` is refused up front;
* a second job into a locked output is refused naming the first (host, pid, start); a lock whose
  owner died is taken over with ``--resume``;
* Ctrl-C says the output is incomplete and how to finish it, and ``--resume`` finishes it;
* a full disk and a read-only destination are one line naming the path; ``--resume`` works once
  space is back.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow.dataset as pds
import pyarrow.parquet as pq
import pytest

from dvidshards.jobs.output import read_manifest
from tests.support.exports import make_export
from tests.support.waiting import HANG_SECONDS, wait_until

ROOT = Path(__file__).resolve().parents[2]

# the command line in a child process
CLI = "import sys; from dvidshards.cli import main; sys.exit(main(sys.argv[1:]))"

_ABSL = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d")  # TensorStore's C++ log lines (outside Python's control)


def _lines(err: str) -> list[str]:
    return [ln for ln in err.strip().splitlines() if ln.strip() and not _ABSL.match(ln)]


@pytest.fixture(scope="module")
def exp(tmp_path_factory):
    e = make_export(tmp_path_factory.mktemp("house") / "exp", shape=(200, 170, 150), seed=5, scales=2)
    with open(os.path.join(e.root, "info"), "w") as f:  # exact geometry, no GeometryWarning
        json.dump(e.spec, f)
    return e


@pytest.fixture(scope="module")
def dump(exp, tmp_path_factory):
    """A DVID /blocks dump of the export's scale 0 (the input of `ingest DUMP EXPORT`)."""
    from tests.support.blocks import export_blocks
    from tests.support.blockstream import write_stream

    p = tmp_path_factory.mktemp("dump") / "blocks.dat"
    p.write_bytes(write_stream(export_blocks(Path(exp.root))))
    return p


def _needs(job: str) -> None:
    if job == "pcg-edges":
        pytest.importorskip("google.protobuf")


def job_args(job: str, exp, dest, dump=None, scale: int = 1) -> list[str]:
    """The command line of one job from EXPORT (or a dump) into DEST (scale 0: 7 shards, scale 1: one)."""
    k = str(scale)
    if job == "stats":
        return ["stats", exp.root, str(dest), "--scale", k]
    if job == "label-index":
        return ["label-index", exp.root, str(dest), "--scale", k]
    if job == "pcg-edges":
        return ["pcg-edges", exp.root, str(dest), "--chunk-size", "64", "64", "64", "--scale", k]
    if job == "ingest":
        return ["ingest", exp.root, str(dest), "--scales", k, "--workers", "4"]
    if job == "ingest-blocks":
        return ["ingest", str(dump), str(dest)]
    raise AssertionError(job)


def run_cli(args, *, env=None, cwd=None):
    """``dvidshards ARGS`` in a child process: (exit code, stdout, stderr); the timeout only guards a hang."""
    e = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", CLI, *map(str, args)], capture_output=True, text=True,
                       env=e, cwd=cwd or ROOT, timeout=HANG_SECONDS)
    return r.returncode, r.stdout, r.stderr


def start_cli(args, *, pause: Path):
    """``dvidshards ARGS`` in a child process that, once its first tasks are counted, creates ``pause``
    and waits until the test deletes it (``DVIDSHARDS_PAUSE_FILE``): the test acts on a job known to
    be mid-way, never on a guess of how long it runs."""
    e = {**os.environ, "DVIDSHARDS_PAUSE_FILE": str(pause), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", CLI, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=e, cwd=ROOT)


def wait_for(path: Path, p, what: str) -> None:
    """Wait until the job creates ``path`` (the job itself signals it; it never goes on without us)."""
    try:
        wait_until(path.exists, what, alive=lambda: p.poll() is None)
    except AssertionError as e:
        if p.poll() is None:
            raise
        raise AssertionError(f"{e}: exit {p.returncode}\n{p.stdout.read()}\n{p.stderr.read()}") from None


def tree(folder) -> dict:
    out = {}
    for d, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, folder)] = os.path.getsize(p)
    return out


def stats_rows(dest) -> dict:
    """{label: voxels} of a statistics output (a folder or one file)."""
    if str(dest).endswith(".parquet"):
        t = pq.read_table(dest)
    else:
        t = pds.dataset(dest, format="parquet", partitioning="hive",
                        ignore_prefixes=[".", "_", "dvidshards."]).to_table()
    return dict(zip(t["label"].to_pylist(), t["voxels"].to_pylist(), strict=True))


def brute_voxels(exp, scale: int) -> dict:
    lab, n = np.unique(exp.expected(scale), return_counts=True)
    return {int(a): int(b) for a, b in zip(lab, n, strict=True) if a}


ALL_JOBS = ["stats", "stats.parquet", "label-index", "pcg-edges", "ingest", "ingest-blocks"]


def slow_but_stats(*jobs: str) -> list:
    """The jobs, all but ``stats`` in the slow tier (each runs a job in a child process: ~10 s)."""
    return [j if j == "stats" else pytest.param(j, marks=pytest.mark.slow) for j in jobs]


# --------------------------------------------------------------------------- a bucket that cannot be reached


@contextmanager
def unreachable_endpoint() -> Iterator[tuple[int, list[int]]]:
    """A local port where every connection is reset as soon as it is made (a bucket that cannot be
    reached): yields the port and a list that counts the connections (the attempts made)."""
    attempts: list[int] = []
    srv = socket.create_server(("127.0.0.1", 0), backlog=64)

    def refuse() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:  # closed: the test is over
                return
            attempts.append(1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, no answer
            conn.close()

    th = threading.Thread(target=refuse, daemon=True)
    th.start()
    try:
        yield srv.getsockname()[1], attempts
    finally:
        srv.shutdown(socket.SHUT_RDWR)  # wakes the accept() (a close alone would not)
        srv.close()
        th.join(HANG_SECONDS)


#: attempts of one request to a bucket that cannot be reached: 1 + KvStore's 3 retries (TensorStore's
#: own retries are off); TensorStore's default would be 1 + 32, up to 32 s apart
MAX_ATTEMPTS = 8


def attempts_allowed(job: str) -> range:
    """How many connections a job may make to a bucket that cannot be reached: ingest refuses a
    bucket before trying it (it writes to a local or shared folder), the others try a few times."""
    return range(0, 1) if job.startswith("ingest") else range(1, MAX_ATTEMPTS + 1)


def _unreachable(port: int) -> dict:
    """An environment where TensorStore's gcs and s3 drivers reach only ``port`` on this machine."""
    return {"TENSORSTORE_GCS_HTTP_URL": f"http://127.0.0.1:{port}", "GOOGLE_AUTH_TOKEN_FOR_TESTING": "none",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
            "AWS_REGION": "us-east-1"}


@pytest.mark.parametrize("job", ALL_JOBS)
def test_an_unreachable_bucket_is_refused_in_one_line_after_a_few_attempts(exp, dump, tmp_path, monkeypatch, capsys,
                                                                           job):
    """gs://no-such-bucket/x with no way to reach it (TensorStore pointed at a port that resets every
    connection): exit non-zero after a few attempts, one line, no local folder (no ./gs: either)."""
    from dvidshards.cli import main

    _needs(job.split(".")[0])
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    dest = "gs://no-such-bucket/x" + (".parquet" if job == "stats.parquet" else "")
    with unreachable_endpoint() as (port, attempts):
        for k, v in _unreachable(port).items():
            monkeypatch.setenv(k, v)
        code = main([*job_args(job.split(".")[0], exp, dest, dump), "--quiet"])
    lines = _lines(capsys.readouterr().err)
    assert code != 0 and len(attempts) in attempts_allowed(job), (code, len(attempts))
    assert len(lines) == 1 and "no-such-bucket" in lines[0] and "Traceback" not in lines[0], lines
    assert os.listdir(cwd) == [] and not list(tmp_path.rglob("gs:*"))


@pytest.mark.slow
@pytest.mark.parametrize("job", ["stats", "stats.parquet", "label-index", "pcg-edges", "ingest"])
def test_an_unreachable_bucket_from_a_fresh_process(exp, tmp_path, job):
    """The same from the command line in its own process, gs:// and s3://."""
    kind = job.split(".")[0]
    _needs(kind)
    for url in ("gs://no-such-bucket/x", "s3://no-such-bucket/x"):
        dest = url + (".parquet" if job == "stats.parquet" else "")
        with unreachable_endpoint() as (port, attempts):
            rc, out, err = run_cli(job_args(kind, exp, dest), env=_unreachable(port), cwd=tmp_path)
        lines = _lines(err)
        assert rc != 0 and len(attempts) in attempts_allowed(job), (rc, len(attempts), err)
        assert len(lines) == 1 and dest in lines[0] and "Traceback" not in err, err
        assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_no_network_bucket_in_this_machines_own_environment(exp, tmp_path):
    """The plain form: nothing set, whatever this machine's network is (none, here)."""
    rc, out, err = run_cli(job_args("stats", exp, "gs://no-such-bucket/x"), cwd=tmp_path)
    assert rc != 0 and len(_lines(err)) == 1 and "no-such-bucket" in err, err
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- the work folder and the output


@pytest.mark.parametrize("name", ["X", "X.parquet"])
def test_stats_out_x_workdir_x_is_refused_up_front(exp, tmp_path, capsys, monkeypatch, name):
    import dvidshards.jobs.stats as stats
    from dvidshards.cli import main

    tasks: list[object] = []
    real = stats.shard_body_stats
    monkeypatch.setattr(stats, "shard_body_stats", lambda *a, **k: tasks.append(a) or real(*a, **k))
    x = tmp_path / name
    assert main(["stats", exp.root, str(x), "--workdir", str(x), "--quiet"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "overlap" in lines[0] and str(x) in lines[0] and "--workdir" in lines[0]
    assert os.listdir(tmp_path) == [] and tasks == []  # nothing made, no task ran
    # a work folder inside the output, or the output inside the work folder: the same
    assert main(["stats", exp.root, str(x), "--workdir", str(x / "w"), "--quiet"]) == 2
    assert main(["stats", exp.root, str(x / "o"), "--workdir", str(x), "--quiet"]) == 2
    assert os.listdir(tmp_path) == [] and tasks == []


def test_an_output_inside_the_export_is_refused(exp, tmp_path, capsys):
    from dvidshards.cli import main

    before = tree(exp.root)
    for args in (["stats", exp.root, os.path.join(exp.root, "sizes")],
                 ["label-index", exp.root, os.path.join(exp.root, "s0", "idx")]):
        assert main([*args, "--quiet"]) == 2
        assert "never writes into its source" in capsys.readouterr().err
    assert tree(exp.root) == before


@pytest.mark.parametrize("job", ["pcg-edges", "stats", "label-index", "ingest"])
def test_a_refused_job_leaves_no_folder_it_made_behind(exp, tmp_path, capsys, job):
    """A destination holding something else is refused before any work; neither the work folder
    made beside it nor one made for --workdir is left behind, and folders that were there stay."""
    from dvidshards.cli import main

    _needs(job)
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "notes.txt").write_text("not a dvidshards output")
    assert main([*job_args(job, exp, dest), "--quiet"]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["out"] and os.listdir(dest) == ["notes.txt"]
    (tmp_path / "kept").mkdir()  # there before, empty: it stays; the folders made inside it go
    assert main([*job_args(job, exp, dest), "--workdir", str(tmp_path / "kept" / "a" / "w"), "--quiet"]) == 2
    assert sorted(os.listdir(tmp_path)) == ["kept", "out"] and os.listdir(tmp_path / "kept") == []


# --------------------------------------------------------------------------- locks


@pytest.mark.parametrize("job", slow_but_stats("stats", "label-index", "pcg-edges", "ingest"))
def test_a_second_job_into_a_locked_output_is_refused_naming_the_first(exp, tmp_path, capsys, job):
    from dvidshards.cli import main

    _needs(job)
    dest = tmp_path / "out"
    args = [*job_args(job, exp, dest, scale=0), "--scheduler", "serial", "--quiet"]
    pause = tmp_path / "paused"
    first = start_cli(args, pause=pause)
    try:
        wait_for(pause, first, "the first job's first tasks")
        lock = json.loads((dest / "_dvidshards.lock").read_text())
        assert lock["pid"] == first.pid and lock["host"] == socket.gethostname()
        for extra in ([], ["--resume"], ["--overwrite"]):  # never two jobs in one output
            assert main([*args, *extra]) == 2
            lines = _lines(capsys.readouterr().err)
            assert len(lines) == 1, lines
            assert f"being written by `dvidshards {job}` (host {lock['host']}, pid {first.pid}, started " \
                   f"{lock['started']})" in lines[0]
        if job in ("stats", "label-index"):  # its work folder is locked too
            assert main([*job_args(job, exp, tmp_path / "other", scale=0), "--workdir", f"{dest}.work"]) == 2
            err = capsys.readouterr().err
            assert f"pid {first.pid}" in err and "out.work" in err, err
        assert first.poll() is None, "the first job ended before the second was refused"
        pause.unlink()  # the first job goes on
        out, err = first.communicate(timeout=HANG_SECONDS)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, err
    m = read_manifest(dest)
    assert m["complete"] is True and m["failed"] == {} and m["status"] == "complete"
    assert f"{m['tasks']['done']:,} of {m['tasks']['total']:,} tasks done, 0 failed" in out  # manifest = summary
    assert not (dest / "_dvidshards.lock").exists() and not (tmp_path / "other").exists()


@pytest.mark.parametrize("job", slow_but_stats("stats", "pcg-edges"))
def test_a_dead_jobs_lock_is_taken_over_with_resume(exp, tmp_path, capsys, job):
    _needs(job)
    dest = tmp_path / "out"
    args = [*job_args(job, exp, dest, scale=0), "--scheduler", "serial", "--quiet"]
    pause = tmp_path / "paused"
    p = start_cli(args, pause=pause)
    try:
        wait_for(pause, p, "the first tasks")
    finally:
        p.kill()  # SIGKILL: no clean-up, the lock stays
        p.wait()
    lock = json.loads((dest / "_dvidshards.lock").read_text())
    assert lock["pid"] == p.pid and read_manifest(dest)["status"] == "running"
    from dvidshards.cli import main

    assert main(args) == 2
    err = capsys.readouterr().err
    assert len(_lines(err)) == 1 and f"pid {p.pid}" in err and "which is gone" in err and "--resume" in err, err
    assert main([*args, "--resume"]) == 0
    m = read_manifest(dest)
    assert m["complete"] is True and not (dest / "_dvidshards.lock").exists()
    if job == "stats":
        assert stats_rows(dest) == brute_voxels(exp, 0) and not Path(f"{dest}.work").exists()
        assert m["tasks"]["kept"] >= 1  # the dead job's finished shards were kept


# --------------------------------------------------------------------------- Ctrl-C


@pytest.mark.parametrize("job", slow_but_stats("stats", "stats.parquet", "label-index", "pcg-edges", "ingest"))
def test_ctrl_c_says_the_output_is_incomplete_and_how_to_finish(exp, tmp_path, job):
    kind = job.split(".")[0]
    _needs(kind)
    dest = tmp_path / ("out.parquet" if job == "stats.parquet" else "out")
    args = [*job_args(kind, exp, dest, scale=0), "--scheduler", "serial", "--quiet"]
    pause = tmp_path / "paused"
    p = start_cli(args, pause=pause)
    try:
        wait_for(pause, p, "the first tasks")
        os.kill(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=HANG_SECONDS)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130 and "Traceback" not in err, err
    assert f"interrupted: {dest} is incomplete" in err and "run the same command with --resume to finish it" in err
    if job != "stats.parquet":
        assert read_manifest(dest)["status"] == "interrupted" and read_manifest(dest)["complete"] is False
    else:
        assert not dest.exists()
    assert not list(tmp_path.rglob("_dvidshards.lock"))  # its locks released
    from dvidshards.cli import main

    assert main([*args, "--resume"]) == 0
    assert read_manifest(dest)["complete"] is True
    if kind == "stats":
        assert stats_rows(dest) == brute_voxels(exp, 0)


# --------------------------------------------------------------------------- a full disk, a read-only destination


def _mount_tmpfs(where: Path, size: str, ro: bool = False) -> bool:
    """A small tmpfs at ``where`` (needs root and the right to mount); False when not possible."""
    if os.name != "posix" or os.geteuid() != 0 or not shutil.which("mount"):
        return False
    where.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if ro else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True)
    return r.returncode == 0


def _umount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "4m"):
        pytest.skip("cannot mount a small tmpfs here (needs root); the simulated full disk test covers it")
    yield disk
    _umount(disk)


def _fill(disk: Path) -> Path:
    """Fill a file system up to the last byte (the filler, to delete when space is back)."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:  # unbuffered: the last write fails here, not at close
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    with open(disk / "filler2", "wb", buffering=0) as f:  # the last bytes too
        try:
            while True:
                f.write(b"\0")
                f.flush()
        except OSError:
            pass
    return filler


@pytest.mark.parametrize("job", ["stats", "stats.parquet", "label-index", "pcg-edges"])
def test_a_full_disk_is_one_line_naming_the_path_then_resume_finishes(exp, small_disk, job, monkeypatch, capsys):
    import dvidshards.jobs.runner as runner
    from dvidshards.cli import main

    kind = job.split(".")[0]
    _needs(kind)
    dest = small_disk / ("sizes.parquet" if job == "stats.parquet" else "out")
    real = runner._call  # every job's tasks run through it
    calls = []

    def filling(*a, **k):  # the disk fills up while the job runs (another program's writes)
        calls.append(1)
        if len(calls) == 2:
            _fill(small_disk)
        return real(*a, **k)

    monkeypatch.setattr(runner, "_call", filling)
    args = [*job_args(kind, exp, dest, scale=0), "--scheduler", "serial", "--quiet"]
    code = main(args)
    out, err = capsys.readouterr()
    assert code in (1, 2) and "Traceback" not in err
    said = [ln for ln in (out + err).splitlines() if "no space left" in ln]
    assert said and all(str(small_disk) in ln for ln in said), out + err
    assert "--resume" in out + err
    if code == 2:  # refused or stopped by the disk: one line on stderr
        assert len(err.strip().splitlines()) == 1
    # space is back: --resume finishes the output
    monkeypatch.setattr(runner, "_call", real)
    os.unlink(small_disk / "filler")
    os.unlink(small_disk / "filler2")
    assert main([*args, "--resume"]) == 0, capsys.readouterr()
    capsys.readouterr()
    assert read_manifest(dest)["complete"] is True
    if kind == "stats":
        assert stats_rows(dest) == brute_voxels(exp, 0)


def test_a_full_disk_simulated_where_no_tmpfs_can_be_mounted(exp, tmp_path, monkeypatch, capsys):
    """Without root: every write through the output layer (a local store's files) fails with ENOSPC
    from the second task on."""
    import builtins

    import dvidshards.jobs.runner as runner
    import dvidshards.stores.local as local_files
    from dvidshards.cli import main

    dest = tmp_path / "sizes"
    full = {"on": False}
    real_open = builtins.open

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, b):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, k):
            return getattr(self.f, k)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def full_open(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        return Full(f) if full["on"] and "w" in mode and str(path).startswith(str(tmp_path)) else f

    real_call = runner._call  # every job's tasks run through it

    def filling(*a, **k):
        full["on"] = True
        return real_call(*a, **k)

    monkeypatch.setattr(local_files, "open", full_open, raising=False)
    monkeypatch.setattr(runner, "_call", filling)
    args = [*job_args("stats", exp, dest, scale=0), "--scheduler", "serial", "--quiet"]
    code = main(args)
    out, err = capsys.readouterr()
    assert code in (1, 2) and "Traceback" not in err
    said = [ln for ln in (out + err).splitlines() if "no space left" in ln]
    assert said and all(str(tmp_path) in ln for ln in said) and "--resume" in out + err, out + err
    full["on"] = False
    monkeypatch.setattr(runner, "_call", real_call)
    assert main([*args, "--resume"]) == 0
    assert stats_rows(dest) == brute_voxels(exp, 0)


@pytest.fixture
def read_only(tmp_path):
    """A folder no job can write into: a read-only tmpfs as root, else a folder without write permission."""
    ro = tmp_path / "ro"
    if os.geteuid() == 0:
        if not _mount_tmpfs(ro, "1m", ro=True):
            pytest.skip("root, and cannot mount a read-only tmpfs here")
        yield ro, "read-only"
        _umount(ro)
        return
    ro.mkdir()
    ro.chmod(0o555)
    yield ro, "permission denied"
    ro.chmod(0o755)


@pytest.mark.parametrize("job", ["stats", "stats.parquet", "label-index", "pcg-edges", "ingest", "ingest-blocks"])
def test_a_read_only_destination_is_one_line_naming_the_path(exp, dump, read_only, job, capsys):
    from dvidshards.cli import main

    kind = job.split(".")[0]
    _needs(kind)
    ro, why = read_only
    dest = ro / ("sizes.parquet" if job == "stats.parquet" else "out")
    code = main([*job_args(kind, exp, dest, dump), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert str(dest) in err and why in err and "Traceback" not in err
    assert os.listdir(ro) == []
