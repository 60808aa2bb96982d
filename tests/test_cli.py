"""The command line as a user meets it: exit codes, one-line errors, help, and the demo."""

from __future__ import annotations

import argparse
import colorsys
import json
import os
import shutil
import sys
import tempfile

import numpy as np
import pytest

from dvidshards.cli import COMMANDS, build_parser, main
from dvidshards.demo import label_colors, region_colors, run_demo


def _run(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out, out.err
    return code, out.out, out.err


def _one_line(err: str) -> str:
    text = err.strip()
    assert text and "\n" not in text, repr(err)
    return text


@pytest.fixture
def spec_file(synthetic_export, tmp_path):
    p = tmp_path / "spec.json"
    p.write_text(json.dumps(synthetic_export.spec))
    return str(p)


@pytest.fixture
def quiet_tmp(tmp_path, monkeypatch):
    """tempfile's folder pointed at an empty folder, to see what is left behind."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


# --------------------------------------------------------------------------- usage


def test_no_arguments_prints_help(capsys):
    code, out, err = _run([], capsys)
    assert code == 0 and out.startswith("usage: dvidshards") and err == ""
    for name in COMMANDS:
        assert name in out


def test_version(capsys):
    from dvidshards import __version__

    code, out, _ = _run(["--version"], capsys)
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
    code, _, err = _run(argv, capsys)
    assert code == 2 and needle in _one_line(err)


# --------------------------------------------------------------------------- info, verify


def test_info(synthetic_export, spec_file, capsys):
    code, out, _ = _run(["info", synthetic_export.root, "--spec", spec_file], capsys)
    assert code == 0
    rows = [line.split() for line in out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["0", "1", "2"]
    assert rows[0][2] == "x".join(map(str, synthetic_export.sv.shape)) and rows[0][4] == "128"
    n_chunks = len({tuple(c) for c in np.argwhere(synthetic_export.sv) // 64})
    assert int(rows[0][6]) == n_chunks and rows[0][-1] == "A"


def test_info_columns_line_up_for_long_keys(dvid_data, tmp_path, capsys):
    """mCNS's keys run to 17 characters ("16384x16384x16384"): every column stays aligned."""
    (tmp_path / "s1").mkdir()
    for ext in ("arrow", "csv"):
        shutil.copy(dvid_data / f"30720_24576_28672.{ext}", tmp_path / "s1" / f"30720_24576_28672.{ext}")
    code, out, _ = _run(["info", str(tmp_path), "--spec", str(dvid_data / "mcns-ng-specs.json"), "--no-chunks"],
                        capsys)
    assert code == 0
    lines = out.splitlines()[1:]
    head = lines[0]
    assert head.split() == ["scale", "key", "size", "(x,y,z)", "resolution", "shard", "shards"]
    ends = [head.index(h) + len(h) for h in ("scale", "key", "(x,y,z)", "resolution", "shard", "shards")]
    rows = [line for line in lines[1:] if line.strip()[0].isdigit()]
    assert len(rows) == 12 and "16384x16384x16384" in rows[-1]
    assert [r.split()[0] for r in rows if r.endswith("no folder")] == [str(k) for k in range(12) if k != 1]
    assert "no folder for s0, s2," in out  # the scales the spec lists and this export lacks, said
    rows = [r for r in rows if not r.endswith("no folder")]
    for r in rows:  # right-aligned cells end where their header ends
        cells = r.split()
        pos = 0
        for c, end in zip(cells, ends, strict=True):
            pos = r.index(c, pos) + len(c)
            assert pos == end, (r, c)


def test_info_errors_are_one_line(tmp_path, synthetic_export, capsys):
    code, _, err = _run(["info", str(tmp_path / "nowhere")], capsys)
    assert code == 2 and "SpecError" in _one_line(err)
    code, _, err = _run(["info", synthetic_export.root, "--spec", str(tmp_path / "absent.json")], capsys)
    assert code == 2 and "absent.json" in _one_line(err)


def test_verify_exit_codes(synthetic_export, spec_file, tmp_path, capsys):
    code, out, err = _run(["verify", synthetic_export.root, "--spec", spec_file], capsys)
    assert code == 0 and "no problems" in out and "\r" not in err  # no bar when not a terminal
    broken = tmp_path / "broken"
    shutil.copytree(synthetic_export.root, broken)
    shard = sorted((broken / "s0").glob("*.arrow"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # truncated
    code, out, _ = _run(["verify", str(broken), "--spec", spec_file], capsys)
    assert code == 1 and "problems" in out
    empty = tmp_path / "empty"
    (empty / "s0").mkdir(parents=True)
    code, out, err = _run(["verify", str(empty), "--spec", spec_file], capsys)
    assert code == 2 and "nothing was checked" in _one_line(err) and "no problems" not in out
    code, _, err = _run(["verify", synthetic_export.root, "--spec", spec_file, "--scale", "9"], capsys)
    assert code == 2 and "scale 9" in _one_line(err)


# --------------------------------------------------------------------------- consolidate


def test_consolidate(synthetic_export, spec_file, tmp_path, capsys):
    out_dir = tmp_path / "index"
    code, out, err = _run(["consolidate", synthetic_export.root, "--spec", spec_file, "--out", str(out_dir)], capsys)
    assert code == 0 and out.count("chunks in") == 3 and "\r" not in err
    assert sorted(p.name for p in out_dir.glob("*.chunks.arrow")) == ["s0.chunks.arrow", "s1.chunks.arrow",
                                                                      "s2.chunks.arrow"]


def test_consolidate_of_every_scale_writes_nothing_when_one_scale_has_no_folder(synthetic_export, spec_file,
                                                                                  tmp_path, capsys):
    root = tmp_path / "exp"
    shutil.copytree(synthetic_export.root, root)
    shutil.rmtree(root / "s2")  # the spec lists s2; the export lacks it
    out_dir = tmp_path / "index"
    code, out, err = _run(["consolidate", str(root), "--spec", spec_file, "--out", str(out_dir)], capsys)
    assert code == 2 and "has no folder s2" in _one_line(err) and out == ""
    assert not out_dir.exists()  # s0's and s1's index files are not left behind


def test_consolidate_bad_out(synthetic_export, spec_file, tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("mine")
    inside = f"{synthetic_export.root}/s0/index"
    for out in ("/proc/dvidshards-unwritable/index", str(a_file), str(a_file / "below"),
                f"{synthetic_export.root}/s0", inside):
        code, _, err = _run(["consolidate", synthetic_export.root, "--spec", spec_file, "--out", out], capsys)
        assert code == 2 and _one_line(err).startswith("dvidshards consolidate: "), out
    assert a_file.read_text() == "mine"
    assert not os.path.exists(inside), "nothing may be written into the export"


def test_warnings_are_one_line_each(synthetic_export, tmp_path, capsys):
    code, _, err = _run(["consolidate", synthetic_export.root, "--out", str(tmp_path / "ix"), "--scale", "0"],
                        capsys)  # no spec: the geometry is guessed, and said so
    lines = err.strip().splitlines()
    assert code == 0 and lines and all(line.startswith("dvidshards consolidate: warning: ") for line in lines), err
    assert any("guessed" in line for line in lines)


# --------------------------------------------------------------------------- demo


def test_demo_bad_arguments_are_refused_before_any_work(tmp_path, quiet_tmp, capsys):
    out = tmp_path / "d"
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for argv, needle in [
        (["--size", "0", "64", "64"], "positive"),
        (["--size", "-5", "64", "64"], "positive"),
        (["--size", "100000", "100000", "100000"], "more than the demo's"),
        (["--png", str(tmp_path / "missing" / "x.png")], "does not exist"),
        (["--png", str(tmp_path / "x.jpg")], "must end in .png"),
        (["--png", str(tmp_path)], "must end in .png"),
        (["--out", str(a_file)], "not a folder"),
        (["--out", "/proc/dvidshards-demo"], "cannot create"),
    ]:
        extra = [] if "--out" in argv else ["--out", str(out)]
        code, _, err = _run(["demo", *argv, *extra], capsys)
        assert code == 2 and needle in _one_line(err) and err.startswith("dvidshards demo: "), (argv, err)
        assert not out.exists(), f"{argv}: work was done before the arguments were checked"
    assert not list(quiet_tmp.iterdir())


def test_demo_small_sizes_and_clean_up(tmp_path, quiet_tmp, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = _run(["demo", "--size", "10", "10", "10"], capsys)
    assert code == 0 and out.count("exact: True") == 2, out
    assert (tmp_path / "dvidshards-demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(quiet_tmp.iterdir()), "the temporary export was left behind"
    keep = tmp_path / "kept"
    code, out, _ = _run(["demo", "--size", "70", "1", "3", "--out", str(keep)], capsys)
    assert code == 0 and (keep / "export" / "s0").is_dir() and (keep / "dvidshards-demo.png").is_file()


def test_demo_result(tmp_path, quiet_tmp):
    lines = []
    res = run_demo(str(tmp_path), size=(200, 180, 130), echo=lines.append, png=str(tmp_path / "x.png"))
    assert "\n".join(lines).count("exact: True") == 2 and res["exact"]
    assert res["agglomerated"].shape == res["supervoxels"].shape == (130, 117, 85)  # [n//10, ceil(3n/4)) per axis
    assert len(np.unique(res["supervoxels"])) > len(np.unique(res["agglomerated"]))
    assert res["png"] == str(tmp_path / "x.png") and (tmp_path / "x.png").stat().st_size > 10_000
    assert not list(quiet_tmp.iterdir())


def test_demo_draws_without_matplotlib(tmp_path, quiet_tmp, monkeypatch):
    """The picture needs only the core dependencies: the PNG is written with numpy and zlib."""
    image = pytest.importorskip("PIL.Image")  # the reference PNG decoder
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith(("matplotlib.", "mpl_toolkits"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    lines = []
    res = run_demo(None, size=(150, 120, 64), echo=lines.append, png=str(tmp_path / "x.png"))
    assert res["exact"] and res["png"] == str(tmp_path / "x.png")
    with image.open(tmp_path / "x.png") as im:
        assert im.format == "PNG" and im.mode == "RGB"
        pixels = np.asarray(im)
    z = res["z"] - res["box"][2].start
    body_rgb, sv_rgb = region_colors(res["agglomerated"][:, :, z].T, res["supervoxels"][:, :, z].T)
    seen = {tuple(c) for c in pixels.reshape(-1, 3).tolist()}
    for rgb in (body_rgb, sv_rgb):  # every body and every supervoxel of the slice is drawn in its colour
        want = {tuple(c) for c in np.round(rgb * 255).astype(np.uint8).reshape(-1, 3).tolist()}
        assert want <= seen, want - seen
    assert not list(quiet_tmp.iterdir())


def test_png_bytes_decode_to_the_image():
    image = pytest.importorskip("PIL.Image")
    import io

    from dvidshards.demo import draw_text, png_bytes, text_width

    rng = np.random.default_rng(4)
    for shape in [(1, 1, 3), (7, 300, 3), (64, 5, 3)]:
        img = rng.integers(0, 256, shape, dtype=np.uint8)
        with image.open(io.BytesIO(png_bytes(img))) as im:
            np.testing.assert_array_equal(np.asarray(im.convert("RGB")), img)
    with pytest.raises(ValueError, match="h, w, 3"):
        png_bytes(np.zeros((0, 4, 3), np.uint8))
    canvas = np.full((30, 80, 3), 255, np.uint8)
    draw_text(canvas, 2, 2, "Hi 42", color=(0, 0, 0))
    ink = np.argwhere((canvas == 0).all(axis=2))
    assert ink.size and ink[:, 1].max() < 2 + text_width("Hi 42") and ink[:, 0].max() < 2 + 14
    draw_text(canvas, 70, 25, "clipped\u00b3")  # past the edges, and a character the font lacks: no error


# --------------------------------------------------------------------------- colours


def _hls(rgb):
    return colorsys.rgb_to_hls(*rgb)


def test_region_colors_neighbours_differ_and_supervoxels_shade_their_body():
    # four bodies in a 2x2 block of touching squares; each split into two supervoxels
    bodies = np.zeros((40, 40), np.uint64)
    svs = np.zeros_like(bodies)
    for k, (y, x) in enumerate([(0, 0), (0, 20), (20, 0), (20, 20)]):
        bodies[y:y + 20, x:x + 20] = 100 + k
        svs[y:y + 20, x:x + 10] = 1000 + 2 * k
        svs[y:y + 20, x + 10:x + 20] = 1001 + 2 * k
    bodies[35:, 35:] = svs[35:, 35:] = 0  # some background
    body_rgb, sv_rgb = region_colors(bodies, svs)
    colour = {int(b): tuple(body_rgb[bodies == b][0]) for b in np.unique(bodies) if b}
    assert len(set(colour.values())) == 4  # all four touch (diagonals within 2 pixels)
    for b in colour:
        in_body = bodies == b
        shades = {tuple(c) for c in sv_rgb[in_body]}
        assert len(shades) == 2, "the two touching supervoxels of a body need two shades"
        hues = {round(_hls(c)[0], 3) for c in shades}
        assert hues == {round(_hls(colour[b])[0], 3)}, "a supervoxel is a shade of its body's hue"
    assert (body_rgb[bodies == 0] == body_rgb[-1, -1]).all() and (sv_rgb[-1, -1] == body_rgb[-1, -1]).all()


def test_label_colors():
    rgb = label_colors(np.array([[0, 1], [2, 1]], np.uint64))
    assert (rgb[0, 0] == 0).all() and (rgb[0, 1] == rgb[1, 1]).all() and (rgb[0, 1] != rgb[1, 0]).any()


def test_verify_spot_checks_a_convert_output(synthetic_export, spec_file, tmp_path, capsys):
    """`dvidshards verify OUT --spot-check N` compares N chunks of a conversion with its source."""
    out = tmp_path / "out"
    code, _, _ = _run(["convert", synthetic_export.root, str(out), "--format", "precomputed", "--spec", spec_file,
                       "--quiet"], capsys)
    assert code == 0
    code, text, _ = _run(["verify", str(out), "--spot-check", "5", "--quiet"], capsys)
    assert code == 0 and "no problems" in text
    m = json.loads((out / "dvidshards.json").read_text())
    for f in (out / m["scales"]["0"]["key"]).glob("*.shard"):
        data = bytearray(f.read_bytes())
        data[-30:] = bytes(30)  # the minishard index and its last chunk's tail
        f.write_bytes(bytes(data))
    code, text, _ = _run(["verify", str(out), "--spot-check", "40", "--quiet"], capsys)
    assert code == 1
    code, _, err = _run(["verify", str(out), "--spot-check", "-1"], capsys)
    assert code == 2 and "--spot-check -1" in _one_line(err)
