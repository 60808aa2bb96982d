"""``dvidshards demo``: write a realistic synthetic export, read it back across shards, check it
voxel for voxel, and draw a slice as a PNG figure.

The export is written as DVID writes one today: scale 0 only, with a spec that lists every
scale. The coarser scales are then made the way DVID makes its own pyramid, by
``dvidshards downsample``, and read back together with scale 0 as one dataset. The figure is
drawn with matplotlib (``pip install 'dvidshards[demo]'``), imported only when a figure is
asked for. Without an output folder the export goes to a temporary folder that is removed at the
end.
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

from dvidshards.errors import DvidShardsError, SpecError

__all__ = ["DEFAULT_SIZE", "DemoDependencyError", "check_size", "dvid_downsample", "label_colors",
           "region_colors", "run_demo", "save_figure"]

DEFAULT_SIZE = (512, 448, 256)
MAX_VOXELS = 1 << 28  # 2 GiB of uint64 supervoxels in memory
SHARD_CHUNKS = 2  # 128-voxel shards, so that even a small demo volume spans several shard files
RESOLUTION = (8.0, 8.0, 8.0)
SCALES = 3  # scales listed in the spec; the export holds scale 0, downsample makes the rest
# well separated hues (degrees) for bodies; supervoxels are lighter or darker shades of them
_HUES = (0, 28, 52, 95, 145, 178, 205, 235, 275, 305, 330)
_SHADES = (0.36, 0.50, 0.64, 0.78)
_INSTALL = "pip install 'dvidshards[demo]'"


class DemoDependencyError(DvidShardsError, ImportError):
    """The demo's figure needs matplotlib, which is not installed; the message says how to get it."""


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
    return s[0], s[1], s[2]


def _box(size) -> tuple[slice, slice, slice]:
    """The region read back: the middle ~65 % of each axis (crossing shard boundaries when the
    volume spans several shards)."""
    lo = [n // 10 for n in size]
    hi = [min(n, max(a + 1, -(-n * 3 // 4))) for a, n in zip(lo, size, strict=True)]
    return slice(lo[0], hi[0]), slice(lo[1], hi[1]), slice(lo[2], hi[2])


def _coarse_box(box, k: int) -> tuple[slice, ...]:
    """The voxels of scale ``k`` covering ``box`` (scale-0 slices)."""
    return tuple(slice(b.start >> k, max((b.start >> k) + 1, -(-b.stop >> k))) for b in box)


# --- DVID's downsampling rule, in plain numpy (the reference the pyramid is checked against) -----


def dvid_downsample(volume: np.ndarray, *, slab: int = 16) -> np.ndarray:
    """One 2×2×2 downsampling step of labels indexed ``[x, y, z]`` by DVID's rule (``downresArray``
    in DVID's ``datatype/common/labels/compressed.go``), written plainly in numpy.

    Each output voxel is the most frequent **non-zero** label of its cell, ties going to the
    smaller id; 0 only when all eight are 0.  Voxels past an odd edge count as 0, so the result
    has ``ceil(n / 2)`` voxels per axis (same dtype, Fortran order).  ``slab``: output z planes
    computed at a time (bounds the temporaries).
    """
    v = np.asarray(volume)
    if v.ndim != 3:
        raise ValueError(f"expected a 3-D volume, got shape {v.shape}")
    nx, ny, nz = v.shape
    ox, oy, oz = -(-nx // 2), -(-ny // 2), -(-nz // 2)
    out = np.zeros((ox, oy, oz), v.dtype, order="F")
    for z0 in range(0, oz, slab):
        z1 = min(oz, z0 + slab)
        part = v[:, :, 2 * z0:2 * z1]
        padded = np.zeros((2 * ox, 2 * oy, 2 * (z1 - z0)), v.dtype)
        padded[:nx, :ny, :part.shape[2]] = part
        cells = padded.reshape(ox, 2, oy, 2, z1 - z0, 2).transpose(0, 2, 4, 1, 3, 5).reshape(-1, 8)
        s = np.sort(cells, axis=1)
        count = np.zeros(s.shape, np.int8)
        for k in range(8):
            count += s == s[:, k:k + 1]
        count[s == 0] = -1  # 0 wins only when all eight are 0 (then every count is -1)
        # the first maximum of a sorted row is the smallest of the most frequent ids
        out[:, :, z0:z1] = s[np.arange(len(s)), count.argmax(axis=1)].reshape(ox, oy, z1 - z0)
    return out


# --- colours -------------------------------------------------------------------------------------


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


def region_colors(bodies: np.ndarray, supervoxels: np.ndarray, background=(0.1, 0.1, 0.1), *,
                  more_bodies=()) -> tuple[np.ndarray, ...]:
    """Float RGB images (body_rgb, sv_rgb, *more_rgb) of one 2-D region given as body and as
    supervoxel ids (0: background): bodies in distinct hues (neighbours within 2 pixels apart),
    each supervoxel a shade of its body's hue (neighbours of one body apart).  ``more_bodies``:
    other images of body ids (the region at a coarser scale), painted with the same hue per body.
    """
    images = [np.asarray(bodies), *(np.asarray(b) for b in more_bodies)]
    body_ids = np.unique(np.concatenate([b[b != 0].ravel() for b in images]))
    pairs = [_neighbours(b) for b in images]
    hue = _greedy_colours(body_ids, np.concatenate(pairs) if pairs else np.zeros((0, 2)), len(_HUES),
                          _hue_distance)
    sv_ids, first = np.unique(supervoxels, return_index=True)
    sv_body = np.asarray(bodies).ravel()[first]
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

    def body_colour(b):
        return rgb(_HUES[hue[b]], 0.55)

    body_rgb = paint(images[0], body_ids, body_colour)
    sv_rgb = paint(supervoxels, sv_ids,
                   lambda s: rgb(_HUES[hue.get(owner[s], 0)], _SHADES[shade[s]]) if owner[s] else (0.5, 0.5, 0.5))
    return (body_rgb, sv_rgb, *(paint(b, body_ids, body_colour) for b in images[1:]))


# --- the figure (matplotlib, imported on use) ----------------------------------------------------


def _matplotlib():
    """matplotlib's Figure and its Agg canvas (no display needed), or DemoDependencyError."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from mpl_toolkits.axes_grid1.anchored_artists import AnchoredSizeBar
    except ImportError:
        raise DemoDependencyError(f"the demo draws its figure with matplotlib, which is not installed: "
                                  f"{_INSTALL}") from None
    return Figure, FigureCanvasAgg, AnchoredSizeBar


def _nice_length(max_nm: float) -> float:
    """The largest 1, 2 or 5 × 10^k nm not above max_nm."""
    if max_nm <= 0:
        return 0.0
    k = 10 ** math.floor(math.log10(max_nm))
    return max(m * k for m in (1, 2, 5) if m * k <= max_nm)


def _length_label(nm: float) -> str:
    return f"{nm / 1000:g} µm" if nm >= 1000 else f"{nm:g} nm"


def _count(img: np.ndarray) -> int:
    return len(np.unique(img[img != 0]))


def save_figure(path: str, bodies: np.ndarray, supervoxels: np.ndarray, *, z: int, resolution,
                origin=(0, 0), coarse=None, shard_extent=None) -> list[tuple[int, int, int, int]]:
    """Save the figure of one z slice as a PNG; each panel's pixel box (left, top, right, bottom;
    row 0 at the top), left to right.  DemoDependencyError without matplotlib.

    ``bodies``, ``supervoxels``: the scale-0 slice (x, y) at voxel ``z``, its first pixel at
    voxel ``origin``; ``resolution``: scale 0's voxel size (nm).  ``coarse`` = (k, bodies_k,
    origin_k): a third panel of scale k's bodies over the region (same colour per body).
    ``shard_extent``: shard side in voxels per scale, drawn as dashed lines.
    """
    Figure, FigureCanvasAgg, AnchoredSizeBar = _matplotlib()
    rx, ry, rz = (float(r) for r in resolution)
    more = [] if coarse is None else [np.asarray(coarse[1]).T]
    rgbs = region_colors(bodies.T, supervoxels.T, more_bodies=more)  # rows are y (down), columns x
    images = [np.round(np.asarray(c) * 255).astype(np.uint8) for c in rgbs]
    w, h = bodies.shape
    x0, y0 = origin[0] * rx, origin[1] * ry
    extent = (x0, x0 + w * rx, y0 + h * ry, y0)  # nm; y grows downwards as in neuroglancer's xy view
    panels = [(images[0], extent, 0, f"Bodies (agglomerated), {_count(bodies)} in view"),
              (images[1], extent, 0, f"Same region, supervoxels, {_count(supervoxels)} in view")]
    if coarse is not None:
        k, ck, corigin = coarse
        f = 2 ** int(k)
        cw, ch = np.asarray(ck).shape
        cx0, cy0 = corigin[0] * rx * f, corigin[1] * ry * f
        panels.append((images[2], (cx0, cx0 + cw * rx * f, cy0 + ch * ry * f, cy0), int(k),
                       f"Bodies at s{k} ({rx * f:g} nm), made by downsample"))

    aspect = (h * ry) / (w * rx)
    panel_in = 3.4
    fig = Figure(figsize=(len(panels) * panel_in + 0.3, panel_in * aspect + 1.05), dpi=150,
                 facecolor="white", layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), sharex=True, sharey=True, squeeze=False)[0]
    bar = _nice_length(w * rx / 4)
    boundaries = 0
    for ax, (img, ext, k, title) in zip(axes, panels, strict=True):
        ax.imshow(img, extent=ext, interpolation="nearest", resample=False)
        ax.set_xlim(extent[0], extent[1])
        ax.set_ylim(extent[2], extent[3])
        ax.set_title(title, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
        for spine in ax.spines.values():
            spine.set_color("0.6")
        side = (shard_extent or {}).get(k)
        if side:
            step_x, step_y = side * rx * 2 ** k, side * ry * 2 ** k
            for xb in np.arange(math.ceil(extent[0] / step_x) * step_x, extent[1], step_x)[:64]:
                ax.axvline(xb, color="white", lw=0.7, ls=(0, (4, 3)), alpha=0.55)
                boundaries += 1
            for yb in np.arange(math.ceil(extent[3] / step_y) * step_y, extent[2], step_y)[:64]:
                ax.axhline(yb, color="white", lw=0.7, ls=(0, (4, 3)), alpha=0.55)
                boundaries += 1
        if bar:
            sb = AnchoredSizeBar(ax.transData, bar, _length_label(bar), "lower right", pad=0.35, borderpad=0.6,
                                 sep=3, frameon=True, color="white", size_vertical=max(w * rx / 150, rx),
                                 fontproperties={"size": 8})
            sb.patch.set(facecolor="black", edgecolor="none", alpha=0.45)
            ax.add_artist(sb)
    fig.suptitle(f"A synthetic DVID export read back{' across shard files' if boundaries else ''}\n"
                 f"z slice {z} ({z * rz:g} nm), voxels {rx:g} × {ry:g} × {rz:g} nm", fontsize=10)
    notes = ["each supervoxel is a shade of its body's colour"]
    if boundaries:
        notes.append("dashed lines: shard file boundaries")
    if coarse is not None:
        notes.append(f"s{coarse[0]} made from s0 by DVID's rule (most frequent non-zero supervoxel), "
                     f"then mapped to bodies")
    fig.supxlabel("   ·   ".join(notes), fontsize=8, color="0.3")
    fig.savefig(path, dpi=fig.dpi, facecolor="white")
    height = fig.canvas.get_width_height()[1]
    boxes = []
    for ax in axes:
        e = ax.get_window_extent()
        boxes.append((math.ceil(e.x0), math.ceil(height - e.y1), math.floor(e.x1), math.floor(height - e.y0)))
    return boxes


# --- the demo ------------------------------------------------------------------------------------


def _coarse_reference(sv: np.ndarray, box, k_max: int) -> dict[int, np.ndarray]:
    """Scales 1..k_max of the volume over ``box`` by DVID's rule (`dvid_downsample`), each from
    the one below, cut to `_coarse_box` (only the region the box needs is downsampled)."""
    step = 1 << k_max
    lo = [b.start // step * step for b in box]
    hi = [min(n, -(-b.stop // step) * step) for b, n in zip(box, sv.shape, strict=True)]
    vol = np.asarray(sv[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]])
    out = {}
    for k in range(1, k_max + 1):
        vol = dvid_downsample(vol)
        cut = _coarse_box(box, k)
        out[k] = vol[tuple(slice(c.start - (a >> k), c.stop - (a >> k)) for c, a in zip(cut, lo, strict=True))]
    return out


def run_demo(out_dir: str | None = None, *, size=DEFAULT_SIZE, seed: int = 7, png: str | None = None,
             echo=print) -> dict:
    """Write a synthetic export as DVID does (scale 0), make its coarser scales as DVID does
    (``downsample``), read a box across shard boundaries at every scale, check it, draw it.

    ``out_dir`` keeps the export (``out_dir/export``), the coarser scales (``out_dir/pyramid``)
    and the spec (``out_dir/spec.json``); default a temporary folder, removed before returning.
    ``size``: voxels (`check_size`); ``seed``: of the synthetic neurons; ``png``: where to save the
    figure (needs matplotlib: DemoDependencyError before any work without it); ``echo`` receives
    each line of the report.

    Returns a dict: ``export``, ``pyramid`` (None when temporary), ``spec``, ``box``;
    ``agglomerated`` and ``supervoxels`` (the box read back at scale 0); ``coarse`` (scale -> the
    box's ``(agglomerated, supervoxels)`` from the pyramid); ``exact`` (scale 0 equals the volume
    written, every coarser scale DVID's rule applied to it, bodies by the mapping); ``seconds``
    (read and downsample times); ``png`` (None when no picture was asked for); ``z`` (the scale-0
    slice drawn); ``panels`` (the figure's panel pixel boxes).
    """
    if png is not None:
        _matplotlib()  # before any work: a missing plotting library is said at once
    import dvidshards
    from dvidshards.demo.neurons import neuron_volume
    from dvidshards.formats.mapping import LabelMapping
    from dvidshards.jobs.downsample import downsample
    from dvidshards.writer import write_export

    size = check_size(size)
    temporary = out_dir is None
    root = tempfile.mkdtemp(prefix="dvidshards-demo-") if out_dir is None else os.fspath(out_dir)
    try:
        export, pyramid = os.path.join(root, "export"), os.path.join(root, "pyramid")
        t = time.perf_counter()
        sv, mapping = neuron_volume(size, n_bodies=40, svs_per_body=6, seed=seed)
        # as DVID's export-shards writes by default: scale 0 only, the spec listing every scale
        spec = write_export(sv, export, mapping=mapping, scales=SCALES, only_scales=[0], resolution=RESOLUTION,
                            shard_chunks=SHARD_CHUNKS, overwrite=True)
        with open(os.path.join(root, "spec.json"), "w") as f:  # DVID writes no spec: keep it beside
            json.dump(spec, f, indent=1)
        ds = dvidshards.Dataset(export, spec=spec)
        echo(f"wrote {export if not temporary else 'a temporary export'}: {'x'.join(map(str, size))} voxels, "
             f"{len(mapping)} supervoxels in {len(np.unique(mapping[:, 1]))} bodies, scale 0 only (as DVID "
             f"exports by default) in {len(ds.shards(0))} shard files ({time.perf_counter() - t:.1f} s)")

        result: dict[str, Any] = {"export": None if temporary else export, "pyramid": None if temporary else pyramid,
                                  "spec": spec, "box": _box(size), "seconds": {}, "png": None, "coarse": {},
                                  "panels": None}
        t = time.perf_counter()
        report = downsample(export, pyramid, spec=spec, overwrite=True, progress=False)
        result["seconds"]["downsample"] = dt = time.perf_counter() - t
        coarse = list(report.scales)
        layers = dvidshards.Dataset([export, pyramid], spec=spec)
        echo(f"  downsample: {', '.join(f's{k}' for k in coarse)} made from s0 the way DVID makes its pyramid: "
             f"{report.totals.records_written} blocks in {' + '.join(str(len(layers.shards(k))) for k in coarse)} "
             f"shard files ({dt:.1f} s)")

        box = result["box"]
        m = LabelMapping.from_any(mapping)
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
        reference = _coarse_reference(sv, box, max(coarse, default=0))
        for k in coarse:  # the pyramid read together with the export, as one dataset
            cut = _coarse_box(box, k)
            t = time.perf_counter()
            got = tuple(dvidshards.open(layers, scale=k, labels=labels, fill_missing_shards=True)[cut]
                        .read(order="F").result() for labels in ("agglomerated", "supervoxels"))
            dt = time.perf_counter() - t
            same = bool(np.array_equal(got[1], reference[k]) and np.array_equal(got[0], m(reference[k])))
            exact &= same
            echo(f"{'s' + str(k):>12}: read {got[0].shape} at {RESOLUTION[0] * 2 ** k:g} nm in {dt * 1000:.0f} ms, "
                 f"{_count(got[0])} bodies, {_count(got[1])} supervoxels, DVID's rule exact: {same}")
            result["coarse"][k] = got
            result["seconds"][f"s{k}"] = dt
        result["exact"] = exact

        sup = result["supervoxels"]
        z = max(range(sup.shape[2]), key=lambda k: (len(np.unique(sup[:, :, k])), -k))  # the busiest slice
        result["z"] = box[2].start + z
        if png is not None:
            third = None
            if 1 in result["coarse"]:
                cut = _coarse_box(box, 1)
                third = (1, result["coarse"][1][0][:, :, (result["z"] >> 1) - cut[2].start],
                         (cut[0].start, cut[1].start))
            result["panels"] = save_figure(
                png, result["agglomerated"][:, :, z], sup[:, :, z], z=result["z"], resolution=RESOLUTION,
                origin=(box[0].start, box[1].start), coarse=third,
                shard_extent={k: layers.scale(k).shard_extent for k in (0, 1) if k < len(layers.scales)})
            result["png"] = png
            echo(f"saved {png}: z slice {result['z']}: bodies, the same region as supervoxels"
                 + (", and as bodies at s1" if third else ""))
        return result
    finally:
        if temporary:  # the export goes with its temporary folder
            shutil.rmtree(root, ignore_errors=True)
