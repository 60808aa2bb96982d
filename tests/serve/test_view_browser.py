"""``dvidshards view`` in a real browser: headless Chromium (WebGL via SwiftShader) through selenium.

The screenshots are compared pixel by pixel with the slice of the volume the export was
written from, coloured with ``neuroglancer.segment_colors`` (the colours the viewer draws).
Skips when no browser is installed, except under CI, where ``.ci/run`` installs one.
"""

from __future__ import annotations

import io
import os
import shutil

import numpy as np
import pytest

from dvidshards.dataset import Dataset
from tests.support.exports import make_export

ng = pytest.importorskip("neuroglancer")
pytest.importorskip("selenium")
Image = pytest.importorskip("PIL.Image")

from dvidshards.serve.view import find_browser, open_browser, screenshot, viewer  # noqa: E402

pytestmark = pytest.mark.slow  # headless Chromium

SHAPE = (200, 170, 150)
W, H = 400, 300  # screenshot size
BACKGROUND = (0, 0, 0)


def _require_browser():
    found = find_browser()
    if found is None:
        msg = "no headless browser: install Debian's chromium and chromium-driver (.ci/run does)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg + "; under CI the browser test must run", pytrace=False)
        pytest.skip(msg)
    return found


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return make_export(tmp_path_factory.mktemp("viewb") / "exp", SHAPE, seed=11)


@pytest.fixture(scope="module")
def browser():
    found = _require_browser()
    v = ng.Viewer()  # any page will do to start the browser; each test loads its own viewer
    drv = open_browser(v.get_viewer_url(), size=(800, 600), browser=found)
    yield drv
    drv.quit()


def show(drv, v, *, scale: float, position) -> None:
    """Load the viewer in the browser: one xy panel, no decorations, opaque segments."""
    with v.txn() as s:
        s.layout = "xy"
        s.position = [float(p) for p in position]
        s.cross_section_scale = scale
        s.show_scale_bar = s.show_axis_lines = s.show_default_annotations = False
        s.cross_section_background_color = "#000000"
        layer = s.layers["segmentation"]
        layer.selected_alpha = layer.not_selected_alpha = 1.0
    drv.get(v.get_viewer_url())


def rgb(hex_string: str) -> tuple[int, int, int]:
    return tuple(int(hex_string[i:i + 2], 16) for i in (1, 3, 5))


def expected_image(vol: np.ndarray, factor: int, position, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """(labels, colours) neuroglancer should draw for the xy slice through position.

    ``vol`` is a scale of the volume, ``factor`` its voxel size in scale-0 voxels; the canvas
    centre is ``position`` (scale-0 voxels) and one pixel spans ``scale`` scale-0 voxels.
    """
    x = np.floor((position[0] + (np.arange(W) + 0.5 - W / 2) * scale) / factor).astype(int)
    y = np.floor((position[1] + (np.arange(H) + 0.5 - H / 2) * scale) / factor).astype(int)
    z = int(position[2] // factor)
    xx, yy = np.broadcast_to(x[None, :], (H, W)), np.broadcast_to(y[:, None], (H, W))
    inside = (xx >= 0) & (xx < vol.shape[0]) & (yy >= 0) & (yy < vol.shape[1])
    lab = np.zeros((H, W), np.uint64)
    lab[inside] = vol[xx[inside], yy[inside], z]
    img = np.zeros((H, W, 3), np.int64)
    img[:] = BACKGROUND
    for b in np.unique(lab[lab != 0]):
        img[lab == b] = rgb(ng.segment_colors.hex_string_from_segment_id(0, int(b)))
    return lab, img


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(np.int64)


def matches(px: np.ndarray, img: np.ndarray) -> np.ndarray:
    return np.abs(px - img).max(axis=-1) <= 2


def body_centre(vol: np.ndarray, z: int, r: int = 5) -> tuple[int, int, int]:
    """A voxel of the biggest body in slice z whose (2r+1)² neighbourhood is that body only."""
    sl = vol[:, :, z]
    ids, counts = np.unique(sl[sl != 0], return_counts=True)
    body = ids[np.argmax(counts)]
    for x, y in zip(*np.nonzero(sl == body), strict=True):
        w = sl[max(x - r, 0):x + r + 1, max(y - r, 0):y + r + 1]
        if w.shape == (2 * r + 1, 2 * r + 1) and (w == body).all():
            return int(x), int(y), int(body)
    raise AssertionError("no body wide enough in this slice")


def test_segmentation_is_drawn_where_the_bodies_are(export, browser):
    vol = export.expected(0)
    z = SHAPE[2] // 2
    x, y, body = body_centre(vol, z)
    pos = (x + 0.5, y + 0.5, z + 0.5)
    v = viewer(Dataset(export.root, spec=export.spec), position=pos)
    try:
        show(browser, v, scale=0.5, position=pos)
        px = pixels(screenshot(v, size=(W, H), timeout=120))
        lab, img = expected_image(vol, 1, pos, 0.5)
        colour = rgb(ng.segment_colors.hex_string_from_segment_id(0, body))
        # the known body's colour, at the centre and wherever the body is
        assert tuple(px[H // 2, W // 2]) == colour
        where = lab == body
        assert where.sum() > 1000 and matches(px, np.array(colour))[where].mean() > 0.99
        # the whole picture: every body in its colour, background where there is none
        assert matches(px, img).mean() > 0.99
        assert len(np.unique(lab)) > 2  # more than one body in view
        # the whole slice, background chunks included: their 404 is drawn as background
        centre = (SHAPE[0] / 2, SHAPE[1] / 2, z + 0.5)
        with v.txn() as s:
            s.position = list(centre)
        px = pixels(screenshot(v, size=(W, H), timeout=120))
        lab, img = expected_image(vol, 1, centre, 0.5)
        assert matches(px, img).mean() > 0.99
        st = v.dvidshards_server.stats()["agglomerated"]
        assert st["absent"]["count"] > 0 and st["failed"]["count"] == 0
        # the layer hidden: background only
        with v.txn() as s:
            s.layers["segmentation"].visible = False
        hidden = pixels(screenshot(v, size=(W, H), timeout=120))
        assert (hidden == BACKGROUND).all(axis=-1).mean() > 0.99
        assert not matches(hidden, px).all()
        st = v.dvidshards_server.stats()["agglomerated"]
        assert st["failed"]["count"] == 0 and st["encoded"]["count"] + st["transcoded"]["count"] > 0
    finally:
        v.dvidshards_server.close()


def test_zoomed_out_reads_the_smallest_scale(export, browser):
    vol = export.expected(2)
    pos = (SHAPE[0] / 2, SHAPE[1] / 2, SHAPE[2] / 2 + 0.5)
    v = viewer(Dataset(export.root, spec=export.spec), position=pos)
    try:
        show(browser, v, scale=8.0, position=pos)  # a pixel = 2 voxels of s2 (8 of s0)
        px = pixels(screenshot(v, size=(W, H), timeout=120))
        lab, img = expected_image(vol, 4, pos, 8.0)
        assert lab.any() and matches(px, img).mean() > 0.99
        keys = [s.to_json()["key"] for s in Dataset(export.root, spec=export.spec).scales]
        served = v.dvidshards_server.stats()["agglomerated"]["scales"]
        assert served.get(keys[2], 0) > 0
        assert served.get(keys[0], 0) == 0, served  # full resolution is never read when zoomed out
    finally:
        v.dvidshards_server.close()


def test_failed_chunks_leave_the_page_working(export, browser, tmp_path):
    root = tmp_path / "exp"
    shutil.copytree(export.root, root)
    ds = Dataset(str(root), spec=export.spec)
    origins = sorted(ds.shards(0))
    bad = origins[len(origins) // 2]
    path = root / "s0" / f"{bad[0]}_{bad[1]}_{bad[2]}.arrow"
    path.write_bytes(path.read_bytes()[:1000])  # truncated
    pos = (bad[0] + 64, bad[1] + 64, bad[2] + 64.5)
    v = viewer(ds, position=pos)
    try:
        show(browser, v, scale=0.5, position=pos)
        stats = []
        with pytest.raises(TimeoutError):  # neuroglancer takes no screenshot while chunks failed
            screenshot(v, size=(W, H), timeout=20, statistics=lambda s: stats.append(s.to_json()))
        total = stats[-1]["total"]
        assert total["visibleChunksFailed"] > 0 and total["visibleChunksDownloading"] == 0
        assert v.dvidshards_server.stats()["agglomerated"]["failed"]["count"] > 0
        # the page still works: away from the bad shard it draws the volume
        vol = export.expected(0)
        z = SHAPE[2] // 2
        good = [o for o in origins if o[2] <= z < o[2] + 128 and (o[0], o[1]) != (bad[0], bad[1])]
        assert good
        for o in good:
            x, y = o[0] + 32, o[1] + 32
            if not vol[x - 16:x + 16, y - 16:y + 16, z].any():
                continue
            p2 = (x + 0.5, y + 0.5, z + 0.5)
            with v.txn() as s:
                s.position = list(p2)
                s.cross_section_scale = 0.1  # 40 x 30 voxels, inside this shard
            px = pixels(screenshot(v, size=(W, H), timeout=120))
            assert matches(px, expected_image(vol, 1, p2, 0.1)[1]).mean() > 0.99
            break
        else:
            pytest.fail("no good shard with data in view")
    finally:
        v.dvidshards_server.close()


def test_view_notebook_executes(monkeypatch):
    """notebooks/view.ipynb runs top to bottom: a real precomputed source and a screenshot."""
    from pathlib import Path

    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    _require_browser()
    path = Path(__file__).resolve().parents[2] / "notebooks" / "view.ipynb"
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    outs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outs)
    assert text.count("exact: True") == 7 and "exact: False" not in text  # 4 demo reads + 3 served scales
    assert "precomputed://http://127.0.0.1:" in text
    pngs = [o["data"]["image/png"] for o in outs if "image/png" in o.get("data", {})]
    assert len(pngs) == 1
    import base64

    px = pixels(base64.b64decode(pngs[0]))
    assert len(np.unique(px.reshape(-1, 3), axis=0)) > 10  # bodies drawn, not an empty canvas


def show_3d(drv, v, body: int, position, scale: float) -> None:
    """Load the viewer in the browser: the 3D panel only, one body selected, no slices."""
    with v.txn() as s:
        s.layout = "3d"
        s.position = [float(p) for p in position]
        s.projection_scale = scale
        s.show_slices = False
        s.show_scale_bar = s.show_axis_lines = s.show_default_annotations = False
        s.projection_background_color = "#000000"
        s.layers["segmentation"].segments = [body]
    drv.get(v.get_viewer_url())


def mesh_pixels(px: np.ndarray, body: int) -> np.ndarray:
    """Pixels drawn in the body's colour, shaded: not background, hue near the segment's."""
    colour = np.array(rgb(ng.segment_colors.hex_string_from_segment_id(0, body)), np.float64)
    lit = (px != BACKGROUND).any(axis=-1) & (px.sum(axis=-1) > 30)
    cos = (px @ colour) / (np.linalg.norm(px, axis=-1) * np.linalg.norm(colour) + 1e-9)
    return lit & (cos > 0.97)


def _biggest_body(vol):
    ids, counts = np.unique(vol[vol != 0], return_counts=True)
    b = int(ids[np.argmax(counts)])
    idx = np.argwhere(vol == b)
    return b, (idx.min(axis=0) + idx.max(axis=0) + 1) / 2, float((idx.max(axis=0) - idx.min(axis=0)).max())


@pytest.mark.slow
def test_a_selected_body_shows_its_mesh_in_3d(export, browser, tmp_path):
    """On demand (scale 0, unsimplified), then from ``dvidshards meshes`` outputs (sharded
    multi-resolution Draco, read by neuroglancer through HTTP ranges) at scale 0 and at the default
    scale (32 nm, s2 here): the body's surface, in its colour, the same picture."""
    pytest.importorskip("zmesh")
    from dvidshards.jobs.meshes import meshes as make_meshes

    vol = export.expected(0)
    body, centre, extent = _biggest_body(vol)
    ds = Dataset(export.root, spec=export.spec)
    assert make_meshes(ds, tmp_path / "m0", scale=0, lods=1, scheduler="serial", progress=False).ok
    default = make_meshes(ds, tmp_path / "m", scheduler="serial", progress=False)
    assert default.ok and default.scales[0] == 2
    shots = {}
    for source, meshes in (("on demand", None), ("s0 output", tmp_path / "m0"), ("default output", tmp_path / "m")):
        v = viewer(ds, position=centre, meshes=meshes, mesh_budget=60.0)  # full resolution on demand
        try:
            show_3d(browser, v, body, centre, scale=extent * 1.1)  # voxels across the panel
            px = shots[source] = pixels(screenshot(v, size=(W, H), timeout=120))
            on = mesh_pixels(px, body)
            assert on.mean() > 0.05, (source, on.mean())  # the body's surface, in its colour
            ys, xs = np.nonzero(on)
            assert abs(xs.mean() - W / 2) < W / 4 and abs(ys.mean() - H / 2) < H / 4  # around the centre
            st = v.dvidshards_server.stats()["agglomerated"]
            if meshes is None:
                assert st["meshes"]["count"] == 1 and st["mesh_files"]["count"] == 0
            else:
                assert st["meshes"]["count"] == 0 and st["mesh_files"]["count"] >= 2  # info + shard ranges
            # no body selected: nothing in the 3D panel
            with v.txn() as s:
                s.layers["segmentation"].segments = []
            empty = pixels(screenshot(v, size=(W, H), timeout=120))
            assert (empty == BACKGROUND).all(axis=-1).mean() > 0.999
        finally:
            v.dvidshards_server.close()
    a, b, c = (mesh_pixels(shots[k], body) for k in ("on demand", "s0 output", "default output"))
    assert (a == b).mean() > 0.99  # the same surface from both sources at scale 0
    assert (a == c).mean() > 0.97, (a == c).mean()  # at 32 nm: the outline moves by up to a voxel there


def test_a_selected_body_shows_its_skeleton_in_3d(browser, tmp_path):
    """The volume's skeleton source (made on demand at 32 nm, s1 here), meshes off: the selected
    body's skeleton is drawn in its colour around its centre; nothing with no body selected."""
    pytest.importorskip("kimimaro")
    e = make_export(tmp_path / "exp", SHAPE, seed=4, scales=2, resolution=(16, 16, 16))
    body, centre, extent = _biggest_body(e.expected(0))
    v = viewer(Dataset(e.root, spec=e.spec), position=centre)
    try:
        with v.txn() as s:
            src = s.layers["segmentation"].source[0].url
            s.layers["segmentation"].source = ng.LayerDataSource(
                url=src, subsources={"default": True, "mesh": False, "skeletons": True})
        show_3d(browser, v, body, centre, scale=extent * 1.1)
        px = pixels(screenshot(v, size=(W, H), timeout=120))
        on = mesh_pixels(px, body)
        assert on.sum() > 200, on.sum()  # lines of the skeleton, in the body's colour
        assert on.sum() > 0.9 * (px != BACKGROUND).any(axis=-1).sum()  # and nothing else drawn
        ys, xs = np.nonzero(on)
        assert abs(xs.mean() - W / 2) < W / 4 and abs(ys.mean() - H / 2) < H / 4
        assert v.dvidshards_server.volume().skeleton.cached(body)
        with v.txn() as s:
            s.layers["segmentation"].segments = []
        assert (pixels(screenshot(v, size=(W, H), timeout=120)) == BACKGROUND).all(axis=-1).mean() > 0.999
    finally:
        v.dvidshards_server.close()
