"""The command line as a user meets it: exit codes, one-line errors, help (the demo: tests/test_demo.py)."""

from __future__ import annotations

import argparse
import json
import os
import shutil

import numpy as np
import pytest

import dvidshards
from dvidshards.cli import COMMANDS, build_parser
from tests.support.cli import one_line, run


@pytest.fixture
def spec_file(synthetic_export, tmp_path):
    p = tmp_path / "spec.json"
    p.write_text(json.dumps(synthetic_export.spec))
    return str(p)


# --------------------------------------------------------------------------- usage


def test_no_arguments_prints_help(capsys):
    code, out, err = run([], capsys)
    assert code == 0 and out.startswith("usage: dvidshards") and err == ""
    for name in COMMANDS:
        assert name in out


def test_version(capsys):
    from dvidshards import __version__

    code, out, _ = run(["--version"], capsys)
    assert code == 0 and out.strip() == f"dvidshards {__version__}"


def test_every_option_has_help():
    for name in COMMANDS:
        p = build_parser(name)
        sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        for action in sub.choices[name]._actions + p._actions:
            if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                assert action.help, f"{name}: {action.option_strings or action.dest} has no help"
        assert sub.choices[name].description


@pytest.mark.parametrize("argv,needle", [
    (["nonsense"], "invalid choice"),
    (["--frobnicate"], "unrecognized arguments"),
    (["info"], "required: source"),
    (["verify", "x", "--scale", "one"], "invalid int value"),
    (["consolidate", "x"], "--out"),
    (["demo", "--size", "10", "10"], "expected 3 arguments"),
])
def test_bad_usage_is_one_line_exit_2(argv, needle, capsys):
    code, _, err = run(argv, capsys)
    assert code == 2 and needle in one_line(err)


# --------------------------------------------------------------------------- info, verify


def test_info(synthetic_export, spec_file, capsys):
    code, out, _ = run(["info", synthetic_export.root, "--spec", spec_file], capsys)
    assert code == 0
    rows = [line.split() for line in out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["0", "1", "2"]
    assert rows[0][2] == "x".join(map(str, synthetic_export.sv.shape)) and rows[0][4] == "128"
    n_chunks = len({tuple(c) for c in np.argwhere(synthetic_export.sv) // 64})
    assert int(rows[0][7]) == n_chunks and rows[0][-1] == "A" and rows[0][5] in ("either", "current", "old")


def test_info_columns_line_up_for_long_keys(dvid_data, tmp_path, capsys):
    """mCNS's keys run to 17 characters ("16384x16384x16384"): every column stays aligned."""
    (tmp_path / "s1").mkdir()
    for ext in ("arrow", "csv"):
        shutil.copy(dvid_data / f"30720_24576_28672.{ext}", tmp_path / "s1" / f"30720_24576_28672.{ext}")
    code, out, _ = run(["info", str(tmp_path), "--spec", str(dvid_data / "mcns-ng-specs.json"), "--no-chunks"],
                        capsys)
    assert code == 0
    lines = out.splitlines()[1:]
    head = lines[0]
    assert head.split() == ["scale", "key", "size", "(x,y,z)", "resolution", "shard", "naming", "shards"]
    ends = [head.index(h) + len(h) for h in ("scale", "key", "(x,y,z)", "resolution", "shard", "naming", "shards")]
    rows = [line for line in lines[1:] if line.strip()[0].isdigit()]
    assert len(rows) == 12 and "16384x16384x16384" in rows[-1]
    assert [r.split()[0] for r in rows if r.endswith("not exported")] == [str(k) for k in range(12) if k != 1]
    assert "not exported: s0, s2-s11" in out  # the scales the spec lists and this export lacks, said
    rows = [r for r in rows if not r.endswith("not exported")]
    for r in rows:  # right-aligned cells end where their header ends
        cells = r.split()
        pos = 0
        for c, end in zip(cells, ends, strict=True):
            pos = r.index(c, pos) + len(c)
            assert pos == end, (r, c)


def test_info_errors_are_one_line(tmp_path, synthetic_export, capsys):
    code, _, err = run(["info", str(tmp_path / "nowhere")], capsys)
    assert code == 2 and "SpecError" in one_line(err)
    code, _, err = run(["info", synthetic_export.root, "--spec", str(tmp_path / "absent.json")], capsys)
    assert code == 2 and "absent.json" in one_line(err)


def test_verify_exit_codes(synthetic_export, spec_file, tmp_path, capsys):
    code, out, err = run(["verify", synthetic_export.root, "--spec", spec_file], capsys)
    assert code == 0 and "no problems" in out and "\r" not in err  # no bar when not a terminal
    broken = tmp_path / "broken"
    shutil.copytree(synthetic_export.root, broken)
    shard = sorted((broken / "s0").glob("*.arrow"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # truncated
    code, out, _ = run(["verify", str(broken), "--spec", spec_file], capsys)
    assert code == 1 and "problems" in out
    empty = tmp_path / "empty"
    (empty / "s0").mkdir(parents=True)
    code, out, err = run(["verify", str(empty), "--spec", spec_file], capsys)
    assert code == 2 and "nothing was checked" in one_line(err) and "no problems" not in out
    code, _, err = run(["verify", synthetic_export.root, "--spec", spec_file, "--scale", "9"], capsys)
    assert code == 2 and "scale 9" in one_line(err)


# --------------------------------------------------------------------------- body


def test_body_skeleton_is_an_swc_tree_per_piece_on_the_body(tmp_path, capsys, monkeypatch):
    """`dvidshards body EXPORT ID --skeleton F.swc`: FlyEM's SWC (scale-0 voxels), every node on a voxel of
    the body, parents before children, one tree per 26-connected piece of the body (brute force); a bad
    file name or a missing kimimaro is one line naming the fix, before any file is written."""
    import sys

    pytest.importorskip("kimimaro")
    cc3d = pytest.importorskip("cc3d")
    from dvidshards.demo.neurons import neuron_volume
    from dvidshards.formats.mapping import LabelMapping
    from dvidshards.formats.skeleton import DUST
    from dvidshards.writer import write_export

    sv, mapping = neuron_volume((256, 192, 64), n_bodies=6, svs_per_body=2, seed=8)
    vol = LabelMapping.from_any(mapping)(np.asarray(sv))
    root = str(tmp_path / "exp")
    write_export(np.asarray(sv), root, mapping=mapping, scales=1, shard_chunks=2, resolution=(32.0,) * 3, info=True)
    ids, counts = np.unique(vol[vol != 0], return_counts=True)
    b = int(ids[np.argmax(counts)])
    swc = tmp_path / "b.swc"
    code, out, _ = run(["body", root, str(b), "--skeleton", str(swc)], capsys)
    assert code == 0, out
    rows = np.array([line.split() for line in swc.read_text().splitlines() if not line.startswith("#")], float)
    node, parent, xyz = rows[:, 0].astype(int), rows[:, 6].astype(int), rows[:, 2:5]
    assert (node == np.arange(1, len(node) + 1)).all() and (parent < node).all()
    mask = vol == b
    vox = np.floor(xyz).astype(int)  # a scale-0 voxel c is written at its centre, c + 0.5
    assert mask[tuple(vox.T)].all() and (rows[:, 5] > 0).all()
    tree, trees = np.zeros(len(node), int), 0
    for i, p in enumerate(parent):  # parents come first: a node is in its parent's tree; a root starts one
        if p > 0:
            tree[i] = tree[p - 1]
        else:
            tree[i], trees = trees, trees + 1
    cc = cc3d.connected_components(mask, connectivity=26)
    piece = cc[tuple(vox.T)]
    assert [len(set(piece[tree == t].tolist())) for t in range(trees)] == [1] * trees
    assert set(np.flatnonzero(np.bincount(cc.reshape(-1)) >= DUST).tolist()) - {0} <= set(piece.tolist())
    assert len(set(piece.tolist())) == trees
    facts = json.loads(out)
    assert facts["skeleton"] == {"file": str(swc), "vertices": len(node), "trees": trees}
    code, _, err = run(["body", root, str(b), "--skeleton", str(tmp_path / "b.txt")], capsys)
    assert code == 2 and ".swc" in one_line(err)
    monkeypatch.setitem(sys.modules, "kimimaro", None)  # as if not installed
    code, _, err = run(["body", root, str(b), "--skeleton", str(tmp_path / "c.swc")], capsys)
    assert code == 2 and "dvidshards[skeleton]" in one_line(err) and not (tmp_path / "c.swc").exists()


# --------------------------------------------------------------------------- consolidate


def test_consolidate(synthetic_export, spec_file, tmp_path, capsys):
    out_dir = tmp_path / "index"
    code, out, err = run(["consolidate", synthetic_export.root, "--spec", spec_file, "--out", str(out_dir)], capsys)
    assert code == 0 and out.count("chunks in") == 3 and "\r" not in err
    assert sorted(p.name for p in out_dir.glob("*.chunks.arrow")) == ["s0.chunks.arrow", "s1.chunks.arrow",
                                                                      "s2.chunks.arrow"]


def test_consolidate_of_a_partial_export_indexes_the_scales_it_holds(synthetic_export, spec_file,
                                                                     tmp_path, capsys):
    root = tmp_path / "exp"
    shutil.copytree(synthetic_export.root, root)
    shutil.rmtree(root / "s2")  # the spec lists s2; the export lacks it
    out_dir = tmp_path / "index"
    code, out, err = run(["consolidate", str(root), "--spec", spec_file, "--out", str(out_dir)], capsys)
    assert code == 0 and "not exported: s2" in out + err
    # asking for the absent scale: one line naming it and how to make it, nothing written
    code, out, err = run(["consolidate", str(root), "--spec", spec_file, "--out", str(tmp_path / "i2"),
                           "--scale", "2"], capsys)
    assert code == 2 and "scale 2 is not exported" in one_line(err) and "downsample" in err
    assert not (tmp_path / "i2").exists()


def test_consolidate_bad_out(synthetic_export, spec_file, tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("mine")
    inside = f"{synthetic_export.root}/s0/index"
    for out in ("/proc/dvidshards-unwritable", "/proc/dvidshards-unwritable/index", str(a_file), str(a_file / "below"),
                f"{synthetic_export.root}/s0", inside):
        code, _, err = run(["consolidate", synthetic_export.root, "--spec", spec_file, "--out", out], capsys)
        assert code == 2 and one_line(err).startswith("dvidshards consolidate: "), out
    assert a_file.read_text() == "mine"
    assert not os.path.exists(inside), "nothing may be written into the export"


def test_warnings_are_one_line_each(synthetic_export, tmp_path, capsys):
    code, _, err = run(["consolidate", synthetic_export.root, "--out", str(tmp_path / "ix"), "--scale", "0"],
                        capsys)  # no spec: the geometry is guessed, and said so
    lines = err.strip().splitlines()
    assert code == 0 and lines and all(line.startswith("dvidshards consolidate: warning: ") for line in lines), err
    assert any("guessed" in line for line in lines)


def test_verify_spot_checks_a_convert_output(synthetic_export, spec_file, tmp_path, capsys):
    """`dvidshards verify OUT --spot-check N` compares N chunks of a conversion with its source."""
    out = tmp_path / "out"
    code, _, _ = run(["convert", synthetic_export.root, str(out), "--format", "precomputed", "--spec", spec_file,
                       "--quiet"], capsys)
    assert code == 0
    code, text, _ = run(["verify", str(out), "--spot-check", "5", "--quiet", "--spec", spec_file], capsys)
    assert code == 0 and "no problems" in text
    m = json.loads((out / "_dvidshards.json").read_text())
    scales = [s for s in dvidshards.Dataset(synthetic_export.root, spec=synthetic_export.spec).scales
              if str(s.index) in m["keys"]]
    slots = [int(np.prod(s.grid)) for s in scales]
    assert f"{sum(min(5, n) for n in slots)} chunks compared with the source" in text
    slots = sum(slots)  # more draws than chunks: each chunk once
    code, text, _ = run(["verify", str(out), "--spot-check", str(10 * slots), "--quiet", "--spec", spec_file], capsys)
    assert code == 0 and f"{slots} chunks compared with the source" in text, text
    m = json.loads((out / "_dvidshards.json").read_text())
    for f in (out / m["keys"]["0"]).glob("*.shard"):
        data = bytearray(f.read_bytes())
        data[-30:] = bytes(30)  # the minishard index and its last chunk's tail
        f.write_bytes(bytes(data))
    code, text, _ = run(["verify", str(out), "--spot-check", "40", "--quiet", "--spec", spec_file], capsys)
    assert code == 1
    code, _, err = run(["verify", str(out), "--spot-check", "-1"], capsys)
    assert code == 2 and "--spot-check -1" in one_line(err)


def test_a_child_outliving_the_command_writes_to_stderr_not_into_a_file_opened_after(tmp_path, capfd):
    """While a command runs, fd 2 is a pipe filtered for C++ log lines. A child process that still
    holds it after the command ends (a compile helper, a server) writes through the filter to the
    real stderr, never into whatever file reused the number of the command's saved stderr."""
    import subprocess
    import sys

    from dvidshards.cli import _NativeLogs

    go = "import sys; sys.stdin.read(); sys.stderr.write('from the child\\n')"
    with _NativeLogs() as logs:
        child = subprocess.Popen([sys.executable, "-c", go], stdin=subprocess.PIPE)
    assert logs.thread.is_alive()  # the child holds the pipe
    with open(tmp_path / "user-data", "wb") as f:  # takes the lowest free numbers
        f.write(b"")
        f.flush()
        child.communicate(b"")  # the child writes now, and ends
        logs.thread.join(timeout=300)
        assert not logs.thread.is_alive()
    assert (tmp_path / "user-data").read_bytes() == b""
    assert "from the child" in capfd.readouterr().err


def test_a_coordinate_beyond_64_bits_is_one_line(synthetic_export, spec_file, tmp_path, capsys):
    """A box corner that does not fit in 64 bits: a SpecError naming the box (exit 2 on the
    command line), from Python reads and from every job's --box."""
    ds = dvidshards.Dataset(synthetic_export.root, spec=synthetic_export.spec)
    with pytest.raises(dvidshards.SpecError, match="64 bits"):
        ds.read([[0, 0, 0], [2**70, 1, 1]])
    code, _, err = run(["convert", synthetic_export.root, str(tmp_path / "o"), "--format", "zarr3", "--spec",
                        spec_file, "--box", "0", "0", "0", "99999999999999999999", "1", "1", "--quiet"], capsys)
    assert code == 2 and "99999999999999999999" in one_line(err)
    assert not (tmp_path / "o").exists()
