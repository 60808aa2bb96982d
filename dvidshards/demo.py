"""``dvidshards demo``: write a realistic synthetic export, read it back across shards, check it
voxel for voxel, and draw a slice as a two-panel figure (needs matplotlib: ``dvidshards[demo]``).

Everything but the picture needs only the core dependencies. Without an output folder the export
goes to a temporary folder that is removed at the end.
"""

from __future__ import annotations

import colorsys
import json
import math
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

from .errors import SpecError

__all__ = ["DEFAULT_SIZE", "check_size", "label_colors", "region_colors", "run_demo", "save_figure"]

DEFAULT_SIZE = (512, 448, 256)
MAX_VOXELS = 1 << 28  # 2 GiB of uint64 supervoxels in memory
SHARD_CHUNKS = 2  # 128-voxel shards, so that even a small demo volume spans several shard files
RESOLUTION = (8.0, 8.0, 8.0)
# well separated hues (degrees) for bodies; supervoxels are lighter or darker shades of them
_HUES = (0, 28, 52, 95, 145, 178, 205, 235, 275, 305, 330)
_SHADES = (0.36, 0.50, 0.64, 0.78)


def check_size(size) -> tuple[int, int, int]:
    """The demo volume size as three positive ints, or SpecError saying what is wrong."""
    try:
        s = tuple(int(v) for v in size)
    except (TypeError, ValueError):
        raise SpecError(f"the size must be three whole numbers of voxels, got {size!r}") from None
    if len(s) != 3 or min(s) < 1:
        raise SpecError(f"the size must be three positive numbers of voxels (x y z), got {size!r}")
    if math.prod(s) > MAX_VOXELS:
        raise SpecError(f"{math.prod(s):,} voxels is more than the demo's {MAX_VOXELS:,} "
                        f"({MAX_VOXELS * 8 >> 30} GiB in memory)")
    return s


def _box(size) -> tuple[slice, slice, slice]:
    """The region read back: the middle ~65 % of each axis (crossing shard boundaries when the
    volume spans several shards)."""
    lo = [n // 10 for n in size]
    hi = [min(n, max(a + 1, -(-n * 3 // 4))) for a, n in zip(lo, size, strict=True)]
    return slice(lo[0], hi[0]), slice(lo[1], hi[1]), slice(lo[2], hi[2])


def label_colors(labels: np.ndarray) -> np.ndarray:
    """A random-looking but stable RGB colour per label (0 is black), shape labels.shape + (3,)."""
    h = np.asarray(labels, np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    h ^= h >> np.uint64(29)
    rgb = np.stack([(h >> np.uint64(s)) & np.uint64(0xFF) for s in (0, 8, 16)], axis=-1).astype(np.uint8)
    rgb = rgb // 2 + 96  # keep colours bright
    rgb[np.asarray(labels) == 0] = 0
    return rgb


def _neighbours(img: np.ndarray, reach: int = 2) -> np.ndarray:
    """(n, 2) pairs of distinct non-zero labels within ``reach`` pixels of each other in a 2-D image."""
    pairs = []
    h, w = img.shape
    for dy in range(0, reach + 1):
        for dx in range(-reach, reach + 1):
            if (dy, dx) <= (0, 0):
                continue
            a = img[:h - dy, max(0, -dx):w - max(0, dx)]
            b = img[dy:, max(0, dx):w - max(0, -dx)]
            m = (a != b) & (a != 0) & (b != 0)
            if m.any():
                pairs.append(np.stack([np.minimum(a[m], b[m]), np.maximum(a[m], b[m])], 1))
    if not pairs:
        return np.zeros((0, 2), img.dtype)
    return np.unique(np.concatenate(pairs), axis=0)


def _greedy_colours(ids: np.ndarray, pairs: np.ndarray, n_colours: int, distance=None) -> dict[int, int]:
    """A colour index per id such that neighbours differ when possible: most-connected ids first;
    among the free colours the one farthest (``distance``) from the neighbours' colours, then the
    least used."""
    adj: dict[int, set[int]] = {int(i): set() for i in ids}
    for a, b in pairs.tolist():
        if a in adj and b in adj:
            adj[a].add(b)
            adj[b].add(a)
    colour: dict[int, int] = {}
    used = [0] * n_colours
    for i in sorted(adj, key=lambda k: (-len(adj[k]), k)):
        taken = {colour[j] for j in adj[i] if j in colour}
        free = [c for c in range(n_colours) if c not in taken] or list(range(n_colours))

        def score(c, taken=taken):
            far = min((distance(c, t) for t in taken), default=0) if distance else 0
            return (-far, used[c], c)

        c = min(free, key=score)
        colour[i] = c
        used[c] += 1
    return colour


def _hue_distance(a: int, b: int) -> int:
    d = abs(_HUES[a] - _HUES[b]) % 360
    return min(d, 360 - d)


def region_colors(bodies: np.ndarray, supervoxels: np.ndarray, background=(0.1, 0.1, 0.1)):
    """Colours for one 2-D slice: bodies in distinct hues, each supervoxel a shade of its body's hue.

    Neighbouring bodies (within 2 pixels) get different hues; neighbouring supervoxels of the
    same body different shades.

    Parameters
    ----------
    bodies, supervoxels : numpy.ndarray
        The same 2-D region as agglomerated and as supervoxel ids (0 = background).
    background : RGB tuple, optional

    Returns
    -------
    body_rgb, sv_rgb : numpy.ndarray
        float RGB images, shape ``bodies.shape + (3,)``.
    """
    body_ids = np.unique(bodies[bodies != 0])
    hue = _greedy_colours(body_ids, _neighbours(bodies), len(_HUES), _hue_distance)
    sv_ids, first = np.unique(supervoxels, return_index=True)
    sv_body = bodies.ravel()[first]
    keep = sv_ids != 0
    sv_ids, sv_body = sv_ids[keep], sv_body[keep]
    sv_pairs = _neighbours(supervoxels)
    owner = dict(zip(sv_ids.tolist(), sv_body.tolist(), strict=True))
    same = np.array([owner.get(a) == owner.get(b) for a, b in sv_pairs.tolist()], bool)
    shade = _greedy_colours(sv_ids, sv_pairs[same] if len(sv_pairs) else sv_pairs, len(_SHADES))

    def rgb(h_deg, light):
        return colorsys.hls_to_rgb(h_deg / 360.0, light, 0.72)

    def paint(img, ids, colour_of):
        lut = np.array([background] + [colour_of(i) for i in ids.tolist()], float).reshape(-1, 3)
        if not len(ids):
            return np.broadcast_to(lut[0], img.shape + (3,)).copy()
        pos = np.minimum(np.searchsorted(ids, img), len(ids) - 1)
        return lut[np.where(ids[pos] == img, pos + 1, 0)]

    body_rgb = paint(bodies, body_ids, lambda b: rgb(_HUES[hue[b]], 0.55))
    sv_rgb = paint(supervoxels, sv_ids,
                   lambda s: rgb(_HUES[hue.get(owner[s], 0)], _SHADES[shade[s]]) if owner[s] else (0.5, 0.5, 0.5))
    return body_rgb, sv_rgb


def _nice_length(max_nm: float) -> float:
    """The largest 1, 2 or 5 × 10^k nm not above max_nm."""
    if max_nm <= 0:
        return 0.0
    k = 10 ** math.floor(math.log10(max_nm))
    return max(m * k for m in (1, 2, 5) if m * k <= max_nm)


def save_figure(path: str, bodies: np.ndarray, supervoxels: np.ndarray, *, z: int, resolution,
                origin=(0, 0)) -> None:
    """Save the two-panel figure of one z slice: bodies, and the same region as supervoxels.

    ``bodies`` and ``supervoxels`` are (x, y) slices; ``resolution`` the voxel size (x, y, z) in
    nm; ``z`` the slice's voxel index; ``origin`` the (x, y) voxel of the slice's first pixel.
    Needs matplotlib (imported here, drawn without pyplot so no global state changes).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from mpl_toolkits.axes_grid1.anchored_artists import AnchoredSizeBar

    body_rgb, sv_rgb = region_colors(bodies.T, supervoxels.T)
    h, w = body_rgb.shape[:2]
    rx, ry, rz = (float(r) for r in resolution)
    extent = (origin[0] * rx, (origin[0] + w) * rx, (origin[1] + h) * ry, origin[1] * ry)  # nm, y down
    panel_w = 5.0
    fig = Figure(figsize=(2 * panel_w + 0.3, panel_w * h / w + 0.75), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2, sharex=True, sharey=True)
    n_b = len(np.unique(bodies[bodies != 0]))
    n_s = len(np.unique(supervoxels[supervoxels != 0]))
    bar = _nice_length(w * rx / 4)
    for ax, img, title in ((axes[0], body_rgb, f"Bodies (agglomerated): {n_b}"),
                           (axes[1], sv_rgb, f"Same region, supervoxels: {n_s}")):
        ax.imshow(img, extent=extent, interpolation="nearest")
        ax.set_title(title, fontsize=11)
        ax.set_xticks([])
        ax.set_yticks([])
        if bar:
            sb = AnchoredSizeBar(ax.transData, bar, f"{bar:g} nm", "lower right", pad=0.3, borderpad=0.6,
                                 sep=3, color="white", frameon=True, size_vertical=h * ry / 120,
                                 fontproperties={"size": 9})
            sb.patch.set(facecolor="black", edgecolor="none", alpha=0.6)
            ax.add_artist(sb)
    fig.suptitle(f"Synthetic DVID export, z slice {z} ({z * rz:g} nm); voxels {rx:g} × {ry:g} × {rz:g} nm; "
                 f"each supervoxel a shade of its body's colour", fontsize=10)
    fig.savefig(path)


def run_demo(out_dir: str | None = None, *, size=DEFAULT_SIZE, seed: int = 7, png: str | None = None,
             echo=print) -> dict:
    """Write a synthetic multi-scale export, read a box across shard boundaries, check it, draw it.

    Parameters
    ----------
    out_dir : str, optional
        Folder for the export (``out_dir/export``, and ``out_dir/spec.json``); kept. Default: a
        temporary folder, removed before returning.
    size : (x, y, z)
        Volume size in voxels (see `check_size`).
    seed : int
        Seed of the synthetic neurons.
    png : str, optional
        Where to save the figure (needs matplotlib; without it one line says how to get it).
    echo : callable
        Receives each line of the report.

    Returns
    -------
    dict
        ``export``, ``spec``, ``box``, ``agglomerated`` and ``supervoxels`` (the box read back),
        ``exact`` (both equal the volume written), ``seconds`` (read times), ``png`` (None when
        no picture was drawn), ``z`` (slice drawn).
    """
    import dvidshards
    from dvidshards.formats.mapping import LabelMapping
    from dvidshards.testing.synthetic import neuron_volume
    from dvidshards.writer import write_export

    size = check_size(size)
    temporary = out_dir is None
    root = tempfile.mkdtemp(prefix="dvidshards-demo-") if out_dir is None else os.fspath(out_dir)
    try:
        export = os.path.join(root, "export")
        t = time.perf_counter()
        sv, mapping = neuron_volume(size, n_bodies=40, svs_per_body=6, seed=seed)
        spec = write_export(sv, export, mapping=mapping, scales=3, resolution=RESOLUTION,
                            shard_chunks=SHARD_CHUNKS, overwrite=True)
        with open(os.path.join(root, "spec.json"), "w") as f:  # DVID writes no spec: keep it beside
            json.dump(spec, f, indent=1)
        ds = dvidshards.Dataset(export, spec=spec)
        n_shards = [len(ds.shards(s.index)) for s in ds.scales]
        echo(f"wrote {export if not temporary else 'a temporary export'}: {'x'.join(map(str, size))} voxels, "
             f"{len(mapping)} supervoxels in {len(np.unique(mapping[:, 1]))} bodies, scales "
             f"{[s.index for s in ds.scales]}, shard files per scale {n_shards} ({time.perf_counter() - t:.1f} s)")

        box = _box(size)
        m = LabelMapping.from_any(mapping)
        result: dict[str, Any] = {"export": None if temporary else export, "spec": spec, "box": box, "seconds": {}, "png": None}
        exact = True
        for labels in ("agglomerated", "supervoxels"):
            # DVID writes no shard file where every block is background: read those as 0
            vol = dvidshards.open(export, scale=0, labels=labels, spec=spec, fill_missing_shards=True)
            t = time.perf_counter()
            a = vol[box].read(order="F").result()
            dt = time.perf_counter() - t
            ref = np.asarray(sv[box]) if labels == "supervoxels" else m(sv[box])
            same = bool(np.array_equal(a, ref))
            exact &= same
            ids = np.unique(a)
            echo(f"{labels:>12}: read {a.shape} (x,y,z) in {dt * 1000:.0f} ms, {len(ids) - (ids[0] == 0)} ids, "
                 f"{(a == 0).mean():.0%} background, exact: {same}")
            result[labels] = a
            result["seconds"][labels] = dt
        if len(ds.scales) > 1:
            s1 = dvidshards.open(export, scale=1, spec=spec, fill_missing_shards=True)
            sub = tuple(slice(b.start // 2, max(b.start // 2 + 1, b.stop // 2)) for b in box)
            small = s1[sub].read(order="F").result()
            echo(f"     scale 1: {small.shape} at {RESOLUTION[0] * 2:g} nm, {len(np.unique(small[small != 0]))} bodies")
        result["exact"] = exact

        sup = result["supervoxels"]
        z = max(range(sup.shape[2]), key=lambda k: (len(np.unique(sup[:, :, k])), -k))  # the busiest slice
        result["z"] = box[2].start + z
        if png is not None:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                echo("no picture: matplotlib is not installed (pip install 'dvidshards[demo]' to draw it)")
            else:
                save_figure(png, result["agglomerated"][:, :, z], sup[:, :, z], z=result["z"],
                            resolution=RESOLUTION, origin=(box[0].start, box[1].start))
                result["png"] = png
                echo(f"saved {png}: z slice {result['z']}, bodies (left) and the same region as "
                     f"supervoxels (right)")
        return result
    finally:
        if temporary:  # the export goes with its temporary folder
            shutil.rmtree(root, ignore_errors=True)
