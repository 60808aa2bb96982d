"""`dvidshards demo`: its command line, its checks, DVID's downsampling rule, colours and the figure."""

from __future__ import annotations

import colorsys
import itertools
import subprocess
import sys
import tempfile
from collections import Counter

import numpy as np
import pytest

from dvidshards.demo import (
    DemoDependencyError,
    dvid_downsample,
    label_colors,
    region_colors,
    run_demo,
)
from dvidshards.demo.neurons import neuron_volume
from dvidshards.formats.mapping import LabelMapping
from tests.support.cli import one_line, run


@pytest.fixture
def quiet_tmp(tmp_path, monkeypatch):
    """tempfile's folder pointed at an empty folder, to see what is left behind."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


@pytest.fixture
def no_matplotlib(monkeypatch):
    """``import matplotlib`` (and mpl_toolkits) raise ImportError, as when it is not installed."""
    for name in [m for m in sys.modules if m.split(".")[0] in ("matplotlib", "mpl_toolkits")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "mpl_toolkits", None)


# --------------------------------------------------------------------------- command line


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
        code, _, err = run(["demo", *argv, *extra], capsys)
        assert code == 2 and needle in one_line(err) and err.startswith("dvidshards demo: "), (argv, err)
        assert not out.exists(), f"{argv}: work was done before the arguments were checked"
    assert not list(quiet_tmp.iterdir())


def test_demo_small_sizes_and_clean_up(tmp_path, quiet_tmp, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(["demo", "--size", "10", "10", "10"], capsys)
    assert code == 0 and out.count("exact: True") == 4 and "exact: False" not in out, out  # s0 twice, s1, s2
    assert (tmp_path / "dvidshards-demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(quiet_tmp.iterdir()), "the temporary export was left behind"
    keep = tmp_path / "kept"
    for _ in range(2):  # the same --out again: the export and its pyramid are replaced
        code, out, _ = run(["demo", "--size", "70", "1", "3", "--out", str(keep)], capsys)
        assert code == 0 and out.count("exact: True") == 4 and "exact: False" not in out, out
    assert (keep / "dvidshards-demo.png").is_file() and (keep / "spec.json").is_file()
    assert sorted(p.name for p in (keep / "export").iterdir()) == ["s0"]  # DVID's default: scale 0 only
    assert {"s1", "s2"} <= {p.name for p in (keep / "pyramid").iterdir()}


def test_without_matplotlib_one_line_before_any_work(tmp_path, quiet_tmp, capsys, monkeypatch, no_matplotlib):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(["demo", "--size", "40", "40", "40"], capsys)
    line = one_line(err)
    assert code == 2 and line.startswith("dvidshards demo: ") and "pip install 'dvidshards[demo]'" in line, err
    assert "matplotlib" in line and out == ""
    assert not list(quiet_tmp.iterdir()) and not list(tmp_path.glob("*.png")), "work was done"
    with pytest.raises(DemoDependencyError, match=r"pip install 'dvidshards\[demo\]'") as e:
        run_demo(str(tmp_path / "d"), size=(40, 40, 40), png=str(tmp_path / "x.png"), echo=lambda s: None)
    assert isinstance(e.value, ImportError) and not (tmp_path / "d").exists()
    # everything but the picture needs only the core dependencies
    res = run_demo(None, size=(40, 40, 40), echo=lambda s: None)
    assert res["exact"] and res["png"] is None


def test_the_core_never_imports_matplotlib():
    code = ("import sys, dvidshards, dvidshards.demo, dvidshards.cli; "
            "bad = [m for m in sys.modules if m.startswith(('matplotlib', 'mpl_toolkits'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --------------------------------------------------------------------------- what it checks


def test_demo_result(tmp_path, quiet_tmp):
    import dvidshards

    lines: list[str] = []
    size = (200, 180, 130)
    res = run_demo(str(tmp_path), size=size, echo=lines.append, png=str(tmp_path / "x.png"))
    text = "\n".join(lines)
    assert text.count("exact: True") == 4 and "exact: False" not in text and res["exact"], text
    assert res["agglomerated"].shape == res["supervoxels"].shape == (130, 117, 85)  # [n//10, ceil(3n/4)) per axis
    sv, mapping = neuron_volume(size, n_bodies=40, svs_per_body=6, seed=7)  # the volume, made again
    m = LabelMapping.from_any(mapping)
    box = res["box"]
    np.testing.assert_array_equal(res["supervoxels"], sv[box])
    np.testing.assert_array_equal(res["agglomerated"], m(sv[box]))
    assert len(np.unique(res["supervoxels"])) > len(np.unique(res["agglomerated"]))
    # the coarser scales: DVID's rule over the whole volume, each scale from the one below, then cut
    assert sorted(res["coarse"]) == [1, 2]
    whole = sv
    for k in (1, 2):
        whole = dvid_downsample(whole)
        cut = tuple(slice(b.start >> k, -(-b.stop >> k)) for b in box)
        bodies, svs = res["coarse"][k]
        np.testing.assert_array_equal(svs, whole[cut])
        np.testing.assert_array_equal(bodies, m(whole[cut]))
        assert (svs != 0).any()
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["s0"]
    pyramid = dvidshards.Dataset(res["pyramid"])  # the downsample output reads over its source: the whole pyramid
    np.testing.assert_array_equal(pyramid.open(1, labels="supervoxels", fill_missing_shards=True)
                                  .read(order="F").result(), dvid_downsample(sv))
    assert res["png"] == str(tmp_path / "x.png") and (tmp_path / "x.png").stat().st_size > 10_000
    assert not list(quiet_tmp.iterdir())


# --------------------------------------------------------------------------- DVID's rule


def _dvid_rule_brute_force(vol: np.ndarray) -> np.ndarray:
    """Cell by cell, with a Counter: the most frequent non-zero id, ties to the smaller, else 0."""
    out = np.zeros([-(-n // 2) for n in vol.shape], vol.dtype)
    for x, y, z in itertools.product(*(range(n) for n in out.shape)):
        cell = vol[2 * x:2 * x + 2, 2 * y:2 * y + 2, 2 * z:2 * z + 2].ravel().tolist()
        counts = Counter(v for v in cell if v != 0)
        if counts:
            out[x, y, z] = min(counts, key=lambda v: (-counts[v], v))
    return out


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 2, 2), (3, 5, 7), (8, 6, 4), (9, 1, 34)])
def test_dvid_downsample_equals_the_rule_cell_by_cell(shape):
    rng = np.random.default_rng(sum(shape))
    for ids in ([0, 1, 2], [0, 0, 0, 5, 2**40 + 3, 2**63 + 1], [7]):
        vol = rng.choice(np.array(ids, np.uint64), size=shape)
        got = dvid_downsample(vol, slab=3)
        assert got.dtype == vol.dtype and got.flags.f_contiguous
        np.testing.assert_array_equal(got, _dvid_rule_brute_force(vol))


def test_dvid_downsample_ties_and_background():
    vol = np.zeros((2, 2, 2), np.uint64)
    vol.ravel()[:4] = [9, 9, 4, 4]  # 2:2 tie between 9 and 4, four 0s: the smaller id, not 0
    assert dvid_downsample(vol)[0, 0, 0] == 4
    vol.ravel()[:] = [0] * 7 + [3]  # one voxel of 3 among seven 0s (TensorStore's "mode" gives 0)
    assert dvid_downsample(vol)[0, 0, 0] == 3
    assert dvid_downsample(np.zeros((3, 3, 3), np.uint64)).shape == (2, 2, 2)
    with pytest.raises(ValueError, match="3-D"):
        dvid_downsample(np.zeros((4, 4), np.uint64))


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


def test_region_colors_more_bodies_keep_each_body_colour():
    bodies = np.zeros((20, 20), np.uint64)
    bodies[:, :10], bodies[:, 10:] = 5, 6
    coarse = np.zeros((10, 12), np.uint64)
    coarse[:, :5], coarse[:, 5:10], coarse[:, 10:] = 5, 6, 7  # 7 is only at the coarse scale, beside 6
    body_rgb, sv_rgb, coarse_rgb = region_colors(bodies, bodies, more_bodies=[coarse])
    assert coarse_rgb.shape == (10, 12, 3)
    for b, fine, c in ((5, bodies == 5, coarse == 5), (6, bodies == 6, coarse == 6)):
        assert (coarse_rgb[c] == body_rgb[fine][0]).all(), b
    assert (coarse_rgb[0, 10] != coarse_rgb[0, 5]).any()  # 7 differs from its neighbour 6


def test_label_colors():
    rgb = label_colors(np.array([[0, 1], [2, 1]], np.uint64))
    assert (rgb[0, 0] == 0).all() and (rgb[0, 1] == rgb[1, 1]).all() and (rgb[0, 1] != rgb[1, 0]).any()


# --------------------------------------------------------------------------- the figure


def _colours(rgb: np.ndarray, labels: np.ndarray, min_pixels: int) -> set[tuple[int, ...]]:
    """The uint8 colours of the labels covering at least ``min_pixels`` pixels of ``labels``."""
    ids, counts = np.unique(labels[labels != 0], return_counts=True)
    big = np.isin(labels, ids[counts >= min_pixels])
    return {tuple(c) for c in np.round(rgb[big] * 255).astype(np.uint8).tolist()}


def test_figure_panels(tmp_path, quiet_tmp):
    """The PNG decodes (pillow) to the figure's size; each panel shows its own labels in their
    colours, and the panels differ."""
    image = pytest.importorskip("PIL.Image")
    res = run_demo(None, size=(150, 120, 64), echo=lambda s: None, png=str(tmp_path / "x.png"))
    assert res["exact"] and res["png"] == str(tmp_path / "x.png")
    with image.open(tmp_path / "x.png") as im:
        assert im.format == "PNG" and im.mode in ("RGB", "RGBA")
        pixels = np.asarray(im.convert("RGB"))
    h, w = pixels.shape[:2]
    boxes = res["panels"]
    assert 600 <= w <= 2400 and 300 <= h <= 1200, (w, h)
    assert all(0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h for x0, y0, x1, y1 in boxes)
    assert [b[0] for b in boxes] == sorted(b[0] for b in boxes) and all(
        a[2] <= b[0] for a, b in itertools.pairwise(boxes)), "panels side by side, not overlapping"
    crops = [pixels[y0 + 2:y1 - 2, x0 + 2:x1 - 2] for x0, y0, x1, y1 in boxes]
    assert len({c.shape for c in crops}) <= 2  # same size, give or take a pixel
    z = res["z"] - res["box"][2].start
    bodies, svs = res["agglomerated"][:, :, z].T, res["supervoxels"][:, :, z].T
    assert len(boxes) == 3
    s1_bodies = res["coarse"][1][0][:, :, res["z"] // 2 - (res["box"][2].start // 2)].T
    body_rgb, sv_rgb, s1_rgb = region_colors(bodies, svs, more_bodies=[s1_bodies])  # as the figure colours them
    seen = [{tuple(c) for c in crop.reshape(-1, 3).tolist()} for crop in crops]
    # every body and supervoxel big enough not to hide under a dashed line or the scale bar
    assert _colours(body_rgb, bodies, 12) <= seen[0], _colours(body_rgb, bodies, 12) - seen[0]
    assert _colours(sv_rgb, svs, 12) <= seen[1], _colours(sv_rgb, svs, 12) - seen[1]
    shades_only = _colours(sv_rgb, svs, 12) - _colours(body_rgb, bodies, 1)
    assert shades_only and not (shades_only & seen[0]), "the supervoxel panel has its own colours"
    hh, ww = min(k.shape[0] for k in crops), min(k.shape[1] for k in crops)
    a, b, c = (crop[:hh, :ww] for crop in crops)
    assert (a != b).any(axis=2).mean() > 0.02, "the bodies and supervoxel panels look the same"
    # the third panel: the region at s1 (from the pyramid), each body in its scale-0 colour
    assert _colours(s1_rgb, s1_bodies, 4) <= seen[2], _colours(s1_rgb, s1_bodies, 4) - seen[2]
    assert (a != c).any(axis=2).mean() > 0.002, "the s1 panel is the s0 panel"
    background = np.round(np.array([0.1, 0.1, 0.1]) * 255).astype(np.uint8)
    fa, fc = (a != background).any(axis=2), (c != background).any(axis=2)
    assert (fa & fc).sum() / (fa | fc).sum() > 0.5, "the s1 panel does not show the same region"  # ~0.67; 0.34 when
    # shifted by 20 pixels
