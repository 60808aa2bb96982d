"""``dvidshards demo``: write a realistic synthetic export, read it back across shards, check it
voxel for voxel, and draw a slice as a two-panel PNG figure.

Everything, the picture included, needs only the core dependencies (the PNG is written with numpy
and zlib). Without an output folder the export goes to a temporary folder that is removed at the
end.
"""

from __future__ import annotations

import colorsys
import json
import math
import os
import shutil
import struct
import tempfile
import time
import zlib
from typing import Any

import numpy as np

from dvidshards.errors import SpecError

__all__ = ["DEFAULT_SIZE", "check_size", "draw_text", "label_colors", "png_bytes", "region_colors", "run_demo",
           "save_figure", "text_width"]

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


# --- the picture: numpy and zlib only (a PNG is a few zlib-compressed chunks) --------------------

# A 5×7 pixel font (2 more rows for descenders), printable ASCII from " " on: one word per
# character, one base-32 digit per row (bit 4 the leftmost pixel), trailing empty rows left out.
_GLYPHS = (
    "0 4444404 AAA AAVAVAA 4FKE5U4 OP248J3 CIK8LID 448 2488842 8422248 04LEL4 044V44 00000C48 "
    "000V 00000CC 01248G EHJLPHE 4C4444E EH1248V V2421HE 26AIV22 VGU11HE 68GUHHE V124888 "
    "EHHEHHE EHHF12C 0CC0CC 0CC0C48 248G842 00V0V 8421248 EH12404 EH1DLLE EHHHVHH UHHUHHU "
    "EHGGGHE SIHHHIS VGGUGGV VGGUGGG EHGNHHF HHHVHHH E44444E 72222IC HIKOKIH GGGGGGV HRLLHHH "
    "HHPLJHH EHHHHHE UHHUGGG EHHHLID UHHUKIH FGGE11U V444444 HHHHHHE HHHHHA4 HHHLLLA HHA4AHH "
    "HHHA444 V1248GV E88888E 0G8421 E22222E 4AH 000000V 842 00E1FHF GGMPHHU 00EGGHE 11DJHHF "
    "00EHVGE 698S888 00FHHHF1E GGMPHHH 40C444E 2062222IC GGIKOKI C44444E 00QLLLL 00MPHHH "
    "00EHHHE 00UHHHUGG 00FHHHF11 00MPGGG 00FGE1U 88S8896 00HHHJD 00HHHA4 00HHLLA 00HA4AH "
    "00HHHHF1E 00V248V 2448442 4444444 8442448 008L2 "
)
_B32 = "0123456789ABCDEFGHIJKLMNOPQRSTUV"
_FONT = {chr(32 + i): np.array([[(_B32.index(d) >> (4 - c)) & 1 for c in range(5)] for d in g.ljust(9, "0")], bool)
         for i, g in enumerate(_GLYPHS.split())}
PANEL = 480  # longest side of a panel in pixels
_TEXT = 2  # pixels per font pixel
_MARGIN = 16


def text_width(s: str, scale: int = _TEXT) -> int:
    """Width in pixels of ``s`` drawn by `draw_text`."""
    return 6 * scale * len(s) - scale if s else 0


def draw_text(img: np.ndarray, x: int, y: int, s: str, color=(0, 0, 0), scale: int = _TEXT) -> None:
    """Draw ``s`` into an (h, w, 3) uint8 image, top left corner at pixel (x, y), clipped to the
    image. Characters outside printable ASCII are drawn as ``?``."""
    h, w = img.shape[:2]
    for i, ch in enumerate(s):
        glyph = np.kron(_FONT.get(ch, _FONT["?"]), np.ones((scale, scale), bool))
        x0, y0 = x + 6 * scale * i, y
        gy, gx = slice(max(0, -y0), min(glyph.shape[0], h - y0)), slice(max(0, -x0), min(glyph.shape[1], w - x0))
        if gy.start >= gy.stop or gx.start >= gx.stop:
            continue
        region = img[y0 + gy.start:y0 + gy.stop, x0 + gx.start:x0 + gx.stop]
        region[glyph[gy, gx]] = color


def png_bytes(rgb: np.ndarray) -> bytes:
    """An (h, w, 3) uint8 image as the bytes of an 8-bit RGB PNG file."""
    rgb = np.ascontiguousarray(rgb, np.uint8)
    if rgb.ndim != 3 or rgb.shape[2] != 3 or not rgb.shape[0] or not rgb.shape[1]:
        raise ValueError(f"expected a non-empty (h, w, 3) image, got shape {rgb.shape}")
    h, w = rgb.shape[:2]
    rows = np.zeros((h, 1 + 3 * w), np.uint8)  # each row: filter type 0 (none), then its pixels
    rows[:, 1:] = rgb.reshape(h, 3 * w)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows.tobytes(), 6)) + chunk(b"IEND", b""))


def _resize(img: np.ndarray, h: int, w: int) -> np.ndarray:
    """Nearest-neighbour resampling of an (h0, w0, 3) image to (h, w, 3)."""
    ys = (np.arange(h) * img.shape[0]) // h
    xs = (np.arange(w) * img.shape[1]) // w
    return img[ys[:, None], xs[None, :]]


def _scale_bar(panel: np.ndarray, nm_per_px: float) -> None:
    """A white bar of a round length in nm with its label, lower right, on a dark box."""
    h, w = panel.shape[:2]
    bar = _nice_length(w * nm_per_px / 4)
    n = int(round(bar / nm_per_px)) if bar else 0
    label = f"{bar:g} nm"
    if n < 4 or h < 40 or w < text_width(label) + 24:
        return
    bw, bh = max(n, text_width(label)) + 12, 7 * _TEXT + 18
    x0, y0 = w - bw - 8, h - bh - 8
    box = panel[y0:y0 + bh, x0:x0 + bw]
    box[:] = (box * 0.4).astype(np.uint8)
    x = x0 + bw - 6 - n
    panel[y0 + bh - 10:y0 + bh - 6, x:x + n] = 255
    draw_text(panel, x0 + bw - 6 - text_width(label), y0 + 5, label, color=(255, 255, 255))


def save_figure(path: str, bodies: np.ndarray, supervoxels: np.ndarray, *, z: int, resolution,
                origin=(0, 0)) -> None:
    """Save the two-panel figure of one z slice as a PNG: bodies, and the same region as supervoxels.

    ``bodies`` and ``supervoxels`` are (x, y) slices; ``resolution`` the voxel size (x, y, z) in
    nm; ``z`` the slice's voxel index; ``origin`` the (x, y) voxel of the slice's first pixel
    (kept for callers; the scale bar needs only the voxel size). Drawn with numpy and zlib: no
    plotting library.
    """
    body_rgb, sv_rgb = region_colors(bodies.T, supervoxels.T)  # rows are y (down), columns x
    h, w = body_rgb.shape[:2]
    rx, ry, rz = (float(r) for r in resolution)
    # panels keep the voxels' aspect ratio (x and y voxel sizes may differ)
    f = PANEL / max(w * rx, h * ry)
    pw, ph = max(1, round(w * rx * f)), max(1, round(h * ry * f))
    n_b = len(np.unique(bodies[bodies != 0]))
    n_s = len(np.unique(supervoxels[supervoxels != 0]))
    titles = (f"Bodies (agglomerated): {n_b}", f"Same region, supervoxels: {n_s}")
    lines = (f"Synthetic DVID export, z slice {z} ({z * rz:g} nm), voxels {rx:g} x {ry:g} x {rz:g} nm",
             "each supervoxel is a shade of its body's colour")
    line = 9 * _TEXT + 6
    pw_min = max(pw, max(text_width(t) for t in titles))
    width = max(3 * _MARGIN + 2 * pw_min, 2 * _MARGIN + max(text_width(s) for s in lines))
    top = _MARGIN + len(lines) * line + 10
    height = top + line + ph + _MARGIN
    img = np.full((height, width, 3), 255, np.uint8)
    for i, s in enumerate(lines):
        draw_text(img, (width - text_width(s)) // 2, _MARGIN + i * line, s)
    gap = (width - 2 * pw) // 3
    for k, (rgb, title) in enumerate(zip((body_rgb, sv_rgb), titles, strict=True)):
        x0 = gap + k * (pw + gap)
        draw_text(img, x0 + (pw - text_width(title)) // 2, top, title)
        panel = _resize(np.round(rgb * 255).astype(np.uint8), ph, pw)
        _scale_bar(panel, rx * w / pw)
        img[top + line:top + line + ph, x0:x0 + pw] = panel
    with open(path, "wb") as out:
        out.write(png_bytes(img))


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
        Where to save the figure (a PNG file).
    echo : callable
        Receives each line of the report.

    Returns
    -------
    dict
        ``export``, ``spec``, ``box``, ``agglomerated`` and ``supervoxels`` (the box read back),
        ``exact`` (both equal the volume written), ``seconds`` (read times), ``png`` (None when
        no picture was asked for), ``z`` (slice drawn).
    """
    import dvidshards
    from dvidshards.formats.mapping import LabelMapping
    from dvidshards.demo.neurons import neuron_volume
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
            save_figure(png, result["agglomerated"][:, :, z], sup[:, :, z], z=result["z"],
                        resolution=RESOLUTION, origin=(box[0].start, box[1].start))
            result["png"] = png
            echo(f"saved {png}: z slice {result['z']}, bodies (left) and the same region as "
                 f"supervoxels (right)")
        return result
    finally:
        if temporary:  # the export goes with its temporary folder
            shutil.rmtree(root, ignore_errors=True)
