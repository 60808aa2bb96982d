"""neuroglancer's own ``dvid://`` source on serve-dvid, in headless Chromium: the slices it draws
at scales 0-2 equal the export (scale 0 held, 1-2 made by DVID's rule), on a synthetic export and
on the real mCNS shard (one shard far from the origin of a 12-scale volume), and a selected
body's mesh comes from the ``<instance>_meshes`` keyvalue instance."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from tests.serve.test_view_browser import (
    BACKGROUND,
    H,
    W,
    _require_browser,
    body_centre,
    expected_image,
    matches,
    pixels,
    rgb,
)
from tests.support.data import REAL_SHARD
from tests.support.downsample import by_count
from tests.support.exports import make_export

ng = pytest.importorskip("neuroglancer")
pytest.importorskip("selenium")
pytest.importorskip("aiohttp")

from dvidshards.dataset import Dataset  # noqa: E402
from dvidshards.serve.dvid import serve  # noqa: E402
from dvidshards.serve.view import open_browser, screenshot  # noqa: E402

pytestmark = pytest.mark.slow  # headless Chromium

SHAPE = (200, 170, 150)


@pytest.fixture(scope="module")
def browser():
    found = _require_browser()
    v = ng.Viewer()
    drv = open_browser(v.get_viewer_url(), size=(800, 600), browser=found)
    yield drv
    drv.quit()


def made(sv_xyz: np.ndarray, mapping, k: int) -> np.ndarray:
    """Scale k (x, y, z) of a supervoxel volume by DVID's rule, bodies mapped."""
    pad = np.zeros([-(-s // (1 << k)) * (1 << k) for s in sv_xyz.shape], np.uint64)
    pad[tuple(slice(0, s) for s in sv_xyz.shape)] = sv_xyz
    v = pad.T
    for _ in range(k):
        v = by_count(v)
    v = v.T
    if mapping is None:
        return v
    m = np.asarray(mapping, np.uint64).reshape(-1, 2)
    lut = dict(zip(m[:, 0].tolist(), m[:, 1].tolist(), strict=True))
    u, inv = np.unique(v, return_inverse=True)
    return np.asarray([lut.get(int(x), int(x)) for x in u], np.uint64)[inv].reshape(v.shape)


def dvid_viewer(srv, position, *, scale: float, layout: str = "xy", subsources=None):
    # neuroglancer's Python side answers the page's request for DVID credentials from
    # DVID_CREDENTIALS (server=token); serve-dvid ignores the token
    os.environ["DVID_CREDENTIALS"] = f"{srv.url}=unused"
    v = ng.Viewer()
    res = srv.api.info()["Extended"]["VoxelSize"]
    url = f"dvid://{srv.url}/{srv.api.uuid}/segmentation"
    with v.txn() as s:
        s.dimensions = ng.CoordinateSpace(names=["x", "y", "z"], units="nm", scales=res)
        s.layers["segmentation"] = ng.SegmentationLayer(
            source=url if subsources is None else ng.LayerDataSource(url=url, subsources=subsources))
        s.layout = layout
        s.position = [float(p) for p in position]
        s.cross_section_scale = scale
        s.show_scale_bar = s.show_axis_lines = s.show_default_annotations = False
        s.cross_section_background_color = "#000000"
        layer = s.layers["segmentation"]
        layer.selected_alpha = layer.not_selected_alpha = 1.0
    return v


def shown(drv, v, pos, scale: float) -> np.ndarray:
    drv.get(v.get_viewer_url())
    return pixels(screenshot(v, size=(W, H), timeout=180))


@pytest.fixture(scope="module")
def s0_only(tmp_path_factory):
    e = make_export(tmp_path_factory.mktemp("dvidng") / "exp", SHAPE, seed=11, scales=3)
    with open(os.path.join(e.root, "info"), "w") as f:
        json.dump(e.spec, f)
    for k in (1, 2):
        shutil.rmtree(os.path.join(e.root, f"s{k}"))
    return e


def test_slices_at_scales_0_to_2_and_a_mesh(s0_only, browser):
    e = s0_only
    vol0 = e.expected(0)
    z = SHAPE[2] // 2
    x, y, body = body_centre(vol0, z)
    pos = (x + 0.5, y + 0.5, z + 0.5)
    with serve(e.root, port=0, threads=2) as srv:
        for k, scale in ((0, 0.5), (1, 2.0), (2, 8.0)):
            vol = made(e.sv, e.mapping, k)
            v = dvid_viewer(srv, pos, scale=scale)
            px = shown(browser, v, pos, scale)
            lab, img = expected_image(vol, 1 << k, pos, scale)
            assert lab.any() and matches(px, img).mean() > 0.99, k
        drawn_in_3d(browser, srv, pos, body, 400)


def drawn_in_3d(drv, srv, pos, body: int, extent: float, what: str = "meshes") -> None:
    """The 3D panel with ``body`` selected shows its mesh (``<body>.ngmesh``) or, meshes off, its
    skeleton (``<body>_swc``) in its colour; nothing with no body selected."""
    subsources = None if what == "meshes" else {"default": True, "bounds": False, "meshes": False, "skeletons": True}
    v = dvid_viewer(srv, pos, scale=0.5, layout="3d", subsources=subsources)
    with v.txn() as s:
        s.layers["segmentation"].segments = {body}
        s.projection_scale = extent  # scale-0 voxels
    px = shown(drv, v, pos, 0.5)
    colour = np.array(rgb(ng.segment_colors.hex_string_from_segment_id(0, body)))
    assert srv.nodes[0].instances[f"segmentation_{what}"].cached(body)  # neuroglancer asked for it
    drawn = ~(px == BACKGROUND).all(axis=-1)
    lit = px[drawn].astype(float)  # the body's colour, shaded: the same direction in RGB
    cos = lit @ colour / (np.linalg.norm(lit, axis=1) * np.linalg.norm(colour))
    assert drawn.mean() > (0.01 if what == "meshes" else 0.001) and (cos > 0.99).mean() > 0.95, what
    with v.txn() as s:
        s.layers["segmentation"].segments = set()
    assert (pixels(screenshot(v, size=(W, H), timeout=180)) == BACKGROUND).all(axis=-1).mean() > 0.999


def test_the_real_mcns_shard_as_scale_0(dvid_data, tmp_path, browser):
    """The real shard as the only shard of scale 0 of the 12-scale mCNS spec: neuroglancer asks
    for a chunk of every scale over the view (s11 covers the whole volume); the made scales are
    made from the chunks the export holds, so each answers in seconds."""
    root = tmp_path / "real"
    (root / "s0").mkdir(parents=True)
    (root / "s0" / f"{REAL_SHARD}.arrow").symlink_to(dvid_data / f"{REAL_SHARD}.arrow")
    (root / "s0" / f"{REAL_SHARD}.csv").symlink_to(dvid_data / f"{REAL_SHARD}-newformat.csv")
    spec = str(dvid_data / "mcns-ng-specs.json")
    ds = Dataset(str(root), spec=spec)
    c = ds.chunks(0)
    mid = (c.min(axis=0) + c.max(axis=0) + 1) * 64 // 2
    lo = mid // 256 * 256  # a 256-voxel box: its scale-1 and -2 voxels are its own cells
    box = [lo.tolist(), (lo + 256).tolist()]
    sv = ds.read(box, scale=0, labels="supervoxels")
    agg = ds.read(box, scale=0)
    assert agg.any()
    pairs = np.unique(np.stack([sv.ravel(), agg.ravel()], axis=1), axis=0)
    pos = tuple(float(v) + 128.5 for v in lo)
    rel = (128.5, 128.5, 128.5)
    with serve(str(root), spec=spec, port=0, threads=2) as srv:
        for k in (0, 1, 2):  # one pixel per voxel of scale k (at 2 ** k neuroglancer would draw scale k + 1)
            scale = 0.5 if k == 0 else float(1 << k)
            vol = made(sv, pairs, k)
            v = dvid_viewer(srv, pos, scale=scale)
            px = shown(browser, v, pos, scale)
            _, img = expected_image(vol, 1 << k, rel, scale)
            inside, _ = expected_image(np.ones(vol.shape, np.uint64), 1 << k, rel, scale)  # pixels of the box
            inside = inside != 0
            assert inside.sum() > 1000 and img[inside].any() and matches(px, img)[inside].mean() > 0.99, k
        ids, n = np.unique(agg[agg != 0], return_counts=True)
        body = int(ids[np.argmax(n)])  # the body with most voxels in the box, seen from its centre
        centre = tuple(float(v) for v in lo + np.argwhere(agg == body).mean(axis=0))
        drawn_in_3d(browser, srv, centre, body, 600)
        drawn_in_3d(browser, srv, centre, body, 600, "skeletons")  # made at s2 (32 nm) from scale 0
