"""``dvidshards view``: serve an export as a neuroglancer precomputed source and show it.

A server on `dvidshards.serve.http` (aiohttp; CORS for the viewer's origin, at most ``threads``
requests at work at once) answers the routes of an unsharded neuroglancer ``precomputed``
volume:

- ``/{name}/info``: every scale of the export (resolution, voxel offset, size), 64³ chunks,
  ``compressed_segmentation`` encoding, no sharding;
- ``/{name}/{key}/{x0}-{x1}_{y0}-{y1}_{z0}-{z1}``: one chunk, ``compressed_segmentation``
  bytes, clipped at the volume's upper edge like any precomputed volume;
- ``/{name}/mesh/...``: the volume's mesh source (its ``info`` names it). Without a meshes
  output, meshes are made on demand in neuroglancer's legacy format: ``mesh/{id}:0`` lists one
  fragment, ``mesh/{id}:0:mesh``, computed from the body's chunks (``dvidshards.bodies.Body``)
  at the finest scale expected to take under ``mesh_budget`` seconds (2 s), then cached. Given
  a ``dvidshards meshes`` output (``meshes=``), its files are served instead (with byte ranges,
  for the sharded format);
- ``/{name}/skeletons/{id}``: the body's precomputed skeleton (nm, a ``radius`` attribute), from a
  ``dvidshards skeletons`` output (``skeletons=``) or made on demand (where kimimaro is installed).

A chunk with no record (all background) is answered ``404``, which both neuroglancer and
TensorStore's ``neuroglancer_precomputed`` driver read as all zero. A chunk whose read fails
(corrupt shard, unreachable bucket) is answered ``500`` with the typed error in the log; the
server keeps serving every other chunk.

A whole 64³ chunk on DVID's grid is transcoded straight from its record
(``dvidshards.formats.cseg``: no voxel decode). Otherwise (a chunk cut by the volume edge, a
voxel offset off DVID's grid) the voxels are decoded by the bulk reader (``Dataset.read``) and
encoded (the bytes a DVID block of them transcodes to).

neuroglancer is needed only by `viewer` and the command line (extra ``dvidshards[view]``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from aiohttp import web

from ..dataset import Dataset
from ..errors import BlockDecodeError, NotFoundError, SpecError
from ..formats.codec import encode_block
from ..formats.cseg import is_background, transcode
from ..formats.labels import as_labels
from ..formats.mesh import Mesh
from ..formats.multilod import encode_legacy_fragment, legacy_info
from ..formats.skeleton import PRECOMPUTED_INFO
from .http import Busy, Server, application, in_thread
from .meshes import MeshSource, SkeletonSource

__all__ = ["ViewServer", "ViewVolume", "add_arguments", "find_browser", "main", "open_browser", "screenshot",
           "serve", "viewer"]

log = logging.getLogger(__name__)


@dataclass
class RouteStats:
    """Chunks answered by one route: count, bytes sent and seconds spent (end to end)."""

    count: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, n: int, dt: float) -> None:
        self.count += 1
        self.bytes += n
        self.seconds += dt


@dataclass
class ServeStats:
    """What a server has answered, per route (see `ViewServer.stats`)."""

    transcoded: RouteStats = field(default_factory=RouteStats)  # straight from the DVID record
    encoded: RouteStats = field(default_factory=RouteStats)  # decoded voxels, TensorStore encoder
    absent: RouteStats = field(default_factory=RouteStats)  # 404: no record, all background
    failed: RouteStats = field(default_factory=RouteStats)  # 5xx: read error
    busy: int = 0  # 503: no worker slot freed in time
    scales: dict = field(default_factory=dict)  # chunk requests per scale key
    meshes: RouteStats = field(default_factory=RouteStats)  # bodies meshed on demand
    mesh_scales: dict = field(default_factory=dict)  # on-demand meshes per scale key
    mesh_files: RouteStats = field(default_factory=RouteStats)  # files of a meshes output served

    def as_dict(self) -> dict:
        return {k: (vars(v).copy() if isinstance(v, RouteStats) else
                    dict(v) if isinstance(v, dict) else v) for k, v in vars(self).items()}


def _as_dataset(source, spec=None):
    return source if isinstance(source, Dataset) else Dataset(source, spec=spec)


class ViewVolume:
    """One export, with one label choice, as a precomputed segmentation volume.

    Parameters
    ----------
    dataset : Dataset, path or URL
        The export.
    labels : "agglomerated", "supervoxels" or a mapping
        As in `dvidshards.open`.
    transcode, meshes, mesh_budget, skeletons, index :
        As in `serve`.
    """

    def __init__(self, dataset, labels="agglomerated", *, transcode: bool = True, meshes=None,
                 mesh_budget: float = 2.0, skeletons=None, index=None):
        self.dataset = _as_dataset(dataset)
        self.labels = as_labels(labels)  # one LabelSource: the dataset's readers are cached by it
        self.name = self.labels.name
        scales = [s.to_json() for s in self.dataset.scales]
        guessed = []
        for s, sc in zip(scales, self.dataset.scales, strict=True):
            s.pop("sharding", None)  # served unsharded: one key per chunk
            s.setdefault("compressed_segmentation_block_size", [8, 8, 8])
            if sc.resolution is None:  # geometry inferred without a resolution: DVID halves each scale
                s["resolution"] = [float(2 ** sc.index)] * 3
                guessed.append(f"s{sc.index}: {2 ** sc.index}")
        if guessed:
            log.warning("%s: resolution unknown (no spec), served as 2**k per scale (%s); pass the export's "
                        "spec for nm", self.dataset.store.describe(""), ", ".join(guessed))
        self.info: dict[str, Any] = {"@type": "neuroglancer_multiscale_volume", "type": "segmentation", "data_type": "uint64",
                     "num_channels": 1, "scales": scales, "mesh": "mesh"}
        self._by_key = {s["key"]: i for i, s in enumerate(scales)}
        self._position = {sc.index: i for i, sc in enumerate(self.dataset.scales)}
        if len(self._by_key) != len(scales):
            raise SpecError(f"{self.dataset!r}: two scales share a key; keys are {[s['key'] for s in scales]}")
        self.transcode = bool(transcode)
        self.stats = ServeStats()
        self._stats_lock = threading.Lock()
        self.mesh = MeshSource(self.dataset, self.labels, meshes=meshes, budget=mesh_budget, index=index,
                               on_made=self._mesh_made)
        if self.mesh.output is not None and self.mesh.output.folder is None:
            raise SpecError(f"{meshes}: view serves the files of a meshes output in a local folder")
        self.skeleton = None
        if skeletons is not None or importlib.util.find_spec("kimimaro") is not None:  # else none to be had
            self.skeleton = SkeletonSource(self.dataset, self.labels, skeletons=skeletons, index=index)
            self.info["skeletons"] = "skeletons"

    def __repr__(self) -> str:
        return f"ViewVolume({self.dataset!r}, labels={self.name!r})"

    def chunk_box(self, key: str, bounds) -> tuple[int, np.ndarray] | None:
        """(scale number, box) of a chunk request, or None when it is not a chunk of the grid."""
        k = self._by_key.get(key)
        if k is None:
            return None
        s = self.info["scales"][k]
        x0, x1, y0, y1, z0, z1 = bounds
        lo, hi = np.array([x0, y0, z0], np.int64), np.array([x1, y1, z1], np.int64)
        off, size = np.asarray(s["voxel_offset"], np.int64), np.asarray(s["size"], np.int64)
        cs = np.asarray(s["chunk_sizes"][0], np.int64)
        end = off + size
        if np.any(lo < off) or np.any(lo >= end) or np.any((lo - off) % cs):
            return None
        if np.any(hi != np.minimum(lo + cs, end)):
            return None
        return k, np.stack([lo, hi])

    def _whole(self, k: int, box: np.ndarray) -> np.ndarray | None:
        """The DVID chunk that is this box, if it is to be transcoded from its record."""
        cs = np.asarray(self.info["scales"][k]["chunk_sizes"][0])
        lo, hi = box
        return lo // cs if self.transcode and not np.any(lo % cs) and np.all(hi - lo == cs) else None

    def cached(self, k: int, box: np.ndarray) -> bool:
        """Whether the chunk is transcoded from a shard already in memory (no I/O: well under a millisecond)."""
        c = self._whole(k, box)
        if c is None:
            return False
        reader = self.dataset.reader(k, labels=self.labels, fill_missing_shards=True)
        try:
            reader.cache.peek(reader.scale.shard_origin(*(int(v) for v in c)))
        except KeyError:
            return False
        return True

    def chunk(self, k: int, box: np.ndarray) -> tuple[bytes | None, str]:
        """compressed_segmentation bytes of one chunk (None: no data, all 0) and the route used."""
        c = self._whole(k, box)
        if c is not None:  # on DVID's grid
            return self._chunk_from_record(k, c), "transcoded"
        vox = self.dataset.read(box, scale=k, labels=self.labels, threads=1, fill_missing_shards=True)
        if not vox.any():
            return None, "encoded"
        pad = np.zeros([-(-n // 8) * 8 for n in vox.shape], np.uint64)  # cseg pads blocks past the edge
        pad[:vox.shape[0], :vox.shape[1], :vox.shape[2]] = vox
        return transcode(encode_block(np.ascontiguousarray(pad.T))), "encoded"

    def _chunk_from_record(self, k: int, c: np.ndarray):
        """Transcoded bytes of whole chunk c (None: absent or all background)."""
        x, y, z = (int(v) for v in c)
        reader = self.dataset.reader(k, labels=self.labels, fill_missing_shards=True)
        shard = reader.shard(x, y, z)
        i = shard.find(x, y, z) if shard is not None else None
        if i is None:
            reader.absent(shard, x, y, z)
            return None
        t = shard.table([i])
        try:
            data = transcode(t.block(0), reader.labels.palette(t, 0))
        except BlockDecodeError as e:
            if str(e).startswith(t.path):
                raise
            raise BlockDecodeError(f"{t.where(0)}: {e}") from None
        return None if is_background(data, tuple(self.info["scales"][k]["chunk_sizes"][0])[::-1]) else data

    def _mesh_made(self, k: int, nbytes: int, dt: float) -> None:
        key = self.info["scales"][self._position[k]]["key"]
        with self._stats_lock:
            self.stats.meshes.add(nbytes, dt)
            self.stats.mesh_scales[key] = self.stats.mesh_scales.get(key, 0) + 1

    def record(self, k: int, route: str, nbytes: int, dt: float) -> None:
        key = self.info["scales"][k]["key"]
        with self._stats_lock:
            self.stats.scales[key] = self.stats.scales.get(key, 0) + 1
            if route == "busy":
                self.stats.busy += 1
            else:
                getattr(self.stats, route).add(nbytes, dt)


_SEGMENT = re.compile(r"^([0-9]+):0$")
_FRAGMENT = re.compile(r"^([0-9]+):0:mesh$")


def _mesh_file(folder: str, rel: str) -> str:
    """The path of a meshes output's file ``rel`` (404: outside the folder, hidden, a manifest)."""
    path = os.path.normpath(os.path.join(folder, rel))
    if not path.startswith(folder + os.sep) or os.path.basename(path).startswith((".", "_")) \
            or rel.endswith(".json") or not os.path.isfile(path):
        raise web.HTTPNotFound(text=f"no mesh file {rel!r}\n")
    return path


def _mesh_answer(source: MeshSource, rel: str) -> tuple[bytes, str]:
    """(body, content type) of an on-demand request under ``mesh/`` (blocking: runs on the pool)."""
    if rel == "info":
        return json.dumps(legacy_info()).encode(), "application/json"
    m = _SEGMENT.match(rel)
    if m:
        return json.dumps({"fragments": [f"{int(m.group(1))}:0:mesh"]}).encode(), "application/json"
    m = _FRAGMENT.match(rel)
    if m and 0 < int(m.group(1)) < 1 << 64:
        try:
            return source.get(int(m.group(1))), "application/octet-stream"
        except NotFoundError:  # no such body: an empty fragment
            return encode_legacy_fragment(Mesh.empty()), "application/octet-stream"
    raise web.HTTPNotFound(text=f"no mesh file {rel!r}\n")


_CHUNK = r"/{name}/{key:.+}/{x0:\d+}-{x1:\d+}_{y0:\d+}-{y1:\d+}_{z0:\d+}-{z1:\d+}"


class ViewServer:
    """A running precomputed server (its own thread) serving one or more `ViewVolume`.

    Use `serve` to start one. ``with serve(ds) as srv:`` stops it at the end.

    Parameters
    ----------
    bind, port : str, int
        Where to listen (port 0: any free port; a port in use is a `SpecError` naming it).
    threads : int, optional
        Requests at work at once (default: CPU count, at least 2).
    gzip : bool
        gzip answers to clients that accept it.
    admit_timeout : float
        Seconds a request waits for a free worker before it is answered 503 (Retry-After).
    """

    def __init__(self, bind: str = "127.0.0.1", port: int = 0, *, threads: int | None = None,
                 gzip: bool = False, admit_timeout: float = 60.0):
        self.threads = max(2, os.cpu_count() or 2) if threads is None else int(threads)
        self.volumes: dict[str, ViewVolume] = {}
        routes = [web.get("/{name}/info", self._info), web.get("/{name}/mesh/{rel:.+}", self._mesh),
                  web.get("/{name}/skeletons/{rel}", self._skeleton), web.get(_CHUNK, self._chunk)]
        app = application(routes, errors={NotFoundError: 404}, logger=log, threads=self.threads,
                          admit_timeout=admit_timeout, gzip=gzip)
        self._server = Server(app, host=bind, port=port, name="dvidshards-view").start()
        self.url, self.port = self._server.url, self._server.port

    def _volume(self, request: web.Request) -> ViewVolume:
        vol = self.volumes.get(request.match_info["name"])
        if vol is None:
            raise web.HTTPNotFound(text=f"no volume {request.match_info['name']!r}; volumes: {sorted(self.volumes)}\n")
        return vol

    async def _info(self, request: web.Request) -> web.Response:
        return web.json_response(self._volume(request).info)

    async def _chunk(self, request: web.Request) -> web.Response:
        vol, m = self._volume(request), request.match_info
        req = vol.chunk_box(m["key"], [int(m[a]) for a in ("x0", "x1", "y0", "y1", "z0", "z1")])
        if req is None:
            raise web.HTTPNotFound(text=f"not a chunk of this volume: {request.path!r}\n")
        t0 = time.perf_counter()
        try:  # from a shard in memory on the loop itself: a hop to the pool would cost more than the chunk
            data, route = vol.chunk(*req) if vol.cached(*req) else await in_thread(request, vol.chunk, *req)
        except Busy:
            vol.record(req[0], "busy", 0, 0.0)
            raise
        except Exception:
            vol.record(req[0], "failed", 0, time.perf_counter() - t0)
            raise  # answered 500 and logged by the error table
        if data is None:
            vol.record(req[0], "absent", 0, time.perf_counter() - t0)
            return web.Response(status=404, text="no data (background)\n")
        vol.record(req[0], route, len(data), time.perf_counter() - t0)
        return web.Response(body=data, content_type="application/octet-stream")

    async def _mesh(self, request: web.Request) -> web.StreamResponse:
        vol, rel = self._volume(request), request.match_info["rel"]
        out = vol.mesh.output
        if out is not None and out.folder is not None:  # a meshes output's files; aiohttp answers byte ranges
            path = _mesh_file(out.folder, rel)
            with vol._stats_lock:  # the bytes of the range asked for (as aiohttp reads the header)
                vol.stats.mesh_files.add(len(range(*request.http_range.indices(os.path.getsize(path)))), 0.0)
            ctype = "application/json" if rel == "info" else "application/octet-stream"
            return web.FileResponse(path, headers={"Content-Type": ctype})
        body, ctype = await in_thread(request, _mesh_answer, vol.mesh, rel)
        return web.Response(body=body, content_type=ctype)

    async def _skeleton(self, request: web.Request) -> web.Response:
        vol, rel = self._volume(request), request.match_info["rel"]
        if vol.skeleton is None or not (rel == "info" or re.fullmatch(r"[0-9]{1,20}", rel) and 0 < int(rel) < 1 << 64):
            raise web.HTTPNotFound(text=f"no skeleton file {rel!r}\n")
        if rel == "info":
            return web.json_response(PRECOMPUTED_INFO)
        try:
            data = (await in_thread(request, vol.skeleton.get, int(rel))).encode_precomputed()
        except NotFoundError:  # no such body, or too small for one: an empty skeleton (a 404 stalls neuroglancer)
            data = bytes(8)
        return web.Response(body=data, content_type="application/octet-stream")

    def add(self, dataset, labels="agglomerated", *, name: str | None = None, transcode: bool = True,
            meshes=None, mesh_budget: float = 2.0, skeletons=None, index=None) -> str:
        """Serve a volume; returns its source URL (``precomputed://http://host:port/name``).

        ``meshes``, ``mesh_budget``, ``skeletons`` and ``index`` as in `serve`.
        """
        vol = ViewVolume(dataset, labels, transcode=transcode, meshes=meshes, mesh_budget=mesh_budget,
                         skeletons=skeletons, index=index)
        name = name or vol.name
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise SpecError(f"volume name {name!r}: use letters, digits, '_', '.', '-'")
        self.volumes[name] = vol
        return self.source(name)

    def source(self, name: str | None = None) -> str:
        """neuroglancer source URL of a served volume (the only one when name is None)."""
        return "precomputed://" + self.http_url(name)

    def http_url(self, name: str | None = None) -> str:
        """Plain HTTP URL of a served volume's root (for TensorStore's http kvstore)."""
        if name is None:
            if len(self.volumes) != 1:
                raise SpecError(f"name one of the served volumes: {sorted(self.volumes)}")
            (name,) = self.volumes
        return f"{self.url}/{name}"

    def volume(self, name: str | None = None) -> ViewVolume:
        """A served `ViewVolume` (the only one when name is None)."""
        return self.volumes[self.http_url(name).rsplit("/", 1)[1]]

    def stats(self) -> dict:
        """Per volume: chunks answered per route, bytes and seconds (see `ServeStats`)."""
        return {n: v.stats.as_dict() for n, v in self.volumes.items()}

    def wait(self, **ready: Any) -> None:
        """Serve until Ctrl-C, then stop (``ready``: see `http.Server.wait`)."""
        self._server.wait(**ready)

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.close()

    def __enter__(self) -> ViewServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ViewServer({self.url!r}, volumes={sorted(self.volumes)})"


def serve(dataset, labels="agglomerated", *, port: int = 0, bind: str = "127.0.0.1",
          threads: int | None = None, gzip: bool = False, spec=None, transcode: bool = True,
          meshes=None, mesh_budget: float = 2.0, skeletons=None, index=None) -> ViewServer:
    """Serve an export as a neuroglancer precomputed segmentation source.

    Parameters
    ----------
    dataset : Dataset, path or URL
        The export (``spec``: its multiscale spec when a path, see `Dataset`).
    labels : "agglomerated", "supervoxels" or a mapping
        Voxel values (see `dvidshards.open`).
    port, bind : int, str
        Where to listen (0: any free port; ``0.0.0.0``: other machines too, URLs name this host).
    threads : int, optional
        Chunk requests at work at once (default: CPU count, at least 2).
    gzip : bool
        gzip chunk answers to clients that accept it.
    transcode : bool
        Encode whole chunks straight from their DVID records when possible.
    meshes : path, optional
        A ``dvidshards meshes`` output served as the mesh source (default: meshes on demand,
        at the finest scale expected to take ``mesh_budget`` seconds).
    skeletons : path or URL, optional
        A ``dvidshards skeletons`` output served as the skeleton source (default: made on demand
        where kimimaro is installed); neuroglancer draws them with their ``radius``.
    index : BodyIndex or path, optional
        A label index, to find a body's chunks for an on-demand mesh or skeleton without a scan.

    Returns
    -------
    ViewServer
        Running on its own thread; ``.source()`` is the ``precomputed://`` URL.
    """
    srv = ViewServer(bind, port, threads=threads, gzip=gzip)
    try:
        srv.add(_as_dataset(dataset, spec), labels, transcode=transcode, meshes=meshes, mesh_budget=mesh_budget,
                skeletons=skeletons, index=index)
    except BaseException:
        srv.close()
        raise
    return srv


def _neuroglancer():
    try:
        import neuroglancer
    except ImportError:
        raise SpecError("the viewer needs neuroglancer: pip install 'dvidshards[view]'") from None
    return neuroglancer


def viewer(dataset, labels="agglomerated", *, select=(), position=None, image: str | None = None,
           server: ViewServer | None = None, port: int = 0, bind: str = "127.0.0.1", spec=None,
           viewer=None, layer: str = "segmentation", meshes=None, mesh_budget: float = 2.0, skeletons=None,
           index=None):
    """A ``neuroglancer.Viewer`` showing an export (its client ships with neuroglancer).

    Parameters
    ----------
    dataset, labels, spec, meshes, mesh_budget, skeletons, index :
        As in `serve`; selected bodies show their meshes and skeletons in the 3D panel.
    select : iterable of int
        Bodies (segment ids) to select.
    position : (x, y, z), optional
        Starting position in scale-0 voxels (default: the volume's centre).
    image : str, optional
        An EM image layer source (any neuroglancer URL: ``precomputed://``, ``zarr://``, ...).
    server : ViewServer, optional
        Serve from this server (default: a new one on ``bind``/``port``, where neuroglancer's own
        server listens too if it is not running yet).
    viewer : neuroglancer.Viewer, optional
        Add the layer (named ``layer``) to this viewer instead of a new one.

    Returns
    -------
    neuroglancer.Viewer
        ``.dvidshards_server`` is the `ViewServer` (kept alive with the viewer); in a notebook
        show it with ``IPython.display.IFrame(v.get_viewer_url(), width="100%", height=600)``.
    """
    ds = _as_dataset(dataset, spec)
    _neuroglancer()
    own = server is None
    srv = ViewServer(bind, port) if server is None else server
    try:
        src = srv.add(ds, labels, meshes=meshes, mesh_budget=mesh_budget, skeletons=skeletons, index=index)
        v = _show(ds, src, select=select, position=position, image=image, bind=bind, viewer=viewer, layer=layer)
    except BaseException:
        if own:
            srv.close()
        raise
    v.dvidshards_server = srv
    return v


def _show(ds, src: str, *, select=(), position=None, image=None, bind="127.0.0.1", viewer=None,
          layer="segmentation"):
    """A neuroglancer viewer (new or given) with a segmentation layer on a precomputed source."""
    ng = _neuroglancer()
    s0 = ds.scales[0]
    res = list(s0.resolution) if s0.resolution is not None else [float(2 ** s0.index)] * 3  # as served
    pos = (np.asarray(s0.voxel_offset) + np.asarray(s0.size) / 2) if position is None else position
    pos = [float(p) for p in pos]
    if len(pos) != 3:
        raise SpecError(f"position must be x y z, got {position!r}")
    if not ng.server.is_server_running():
        ng.set_server_bind_address(bind, 0)
    v = ng.Viewer() if viewer is None else viewer
    with v.txn() as st:
        st.dimensions = ng.CoordinateSpace(names=["x", "y", "z"], units="nm", scales=res)
        st.position = pos
        if image:
            st.layers["image"] = ng.ImageLayer(source=image)
        st.layers[layer] = ng.SegmentationLayer(source=src, segments=[int(i) for i in (select or ())])
        st.selected_layer.layer = layer
    return v


# ---------------------------------------------------------------------------------------------
# headless browser and screenshots (tests, benchmarks, notebooks)

CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--use-gl=angle",
                  "--use-angle=swiftshader", "--enable-unsafe-swiftshader")


def find_browser() -> tuple[str, str] | None:
    """(chromium, chromedriver) executables if both are installed, else None."""
    import shutil

    if os.access("/usr/bin/chromium", os.X_OK) and os.access("/usr/bin/chromedriver", os.X_OK):
        return "/usr/bin/chromium", "/usr/bin/chromedriver"
    b = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    d = shutil.which("chromedriver")
    return (b, d) if b and d else None


def open_browser(url: str, *, size=(1024, 768), browser: tuple[str, str] | None = None):
    """A headless Chromium (selenium) showing url, with WebGL2 through SwiftShader.

    Raises SpecError when no browser is installed or the page has no WebGL2.
    """
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        raise SpecError("a headless browser needs selenium: pip install 'dvidshards[view]'") from None
    found = browser or find_browser()
    if found is None:
        raise SpecError("no chromium + chromedriver found (Debian: apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = found[0]
    for a in (*CHROMIUM_FLAGS, f"--window-size={size[0]},{size[1]}"):
        opts.add_argument(a)
    drv = webdriver.Chrome(options=opts, service=Service(found[1]))
    try:
        drv.set_page_load_timeout(120)
        drv.get(url)
        if not drv.execute_script("return !!document.createElement('canvas').getContext('webgl2')"):
            raise SpecError(f"{found[0]}: no WebGL2 in the headless page (flags {' '.join(CHROMIUM_FLAGS)})")
    except BaseException:
        drv.quit()
        raise
    return drv


def screenshot(viewer, *, size=None, timeout: float = 120.0, statistics=None):
    """A neuroglancer screenshot (PNG bytes) once the visible chunks are loaded, or TimeoutError
    after ``timeout`` seconds (``viewer.screenshot()`` waits forever without a browser or WebGL).
    ``size``: the canvas (width, height), UI controls hidden meanwhile; ``statistics``: called with
    neuroglancer's screenshot statistics (chunks loaded so far)."""
    prior = None
    if size is not None:
        prior = viewer.config_state.state
        with viewer.config_state.txn() as s:
            s.show_ui_controls = False
            s.show_panel_borders = False
            s.viewer_size = [int(size[0]), int(size[1])]
    try:
        for _ in range(5):  # the canvas size may lag one frame behind viewer_size
            done, out = threading.Event(), cast(list, [])
            viewer.async_screenshot(lambda r, out=out, done=done: (out.append(r), done.set()),
                                    statistics_callback=statistics)
            if not done.wait(timeout):
                raise TimeoutError(f"no neuroglancer screenshot within {timeout:g} s")
            shot = out[0].screenshot
            if size is None or (shot.width, shot.height) == (int(size[0]), int(size[1])):
                return shot.image
        return shot.image
    finally:
        if prior is not None:
            viewer.config_state.set_state(prior)


# ---------------------------------------------------------------------------------------------
# command line


def add_arguments(parser) -> None:
    """Options of ``dvidshards view``."""
    parser.add_argument("source", help="export root (directory, gs://, s3://, http(s):// URL)")
    parser.add_argument("--spec", help="the neuroglancer multiscale spec given to DVID (default: ./info or inferred)")
    parser.add_argument("--labels", default="agglomerated",
                        help="agglomerated (default), supervoxels, or a mapping file")
    parser.add_argument("--port", type=int, default=0, help="port of the precomputed server (0: any free port)")
    parser.add_argument("--bind", default="127.0.0.1", help="address to listen on (0.0.0.0: other machines)")
    parser.add_argument("--select", type=int, nargs="+", default=[], metavar="ID", help="bodies to select")
    parser.add_argument("--position", type=float, nargs=3, metavar=("X", "Y", "Z"),
                        help="starting position in scale-0 voxels (default: the centre)")
    parser.add_argument("--image", metavar="URL", help="an EM image layer (precomputed://, zarr://, ...)")
    parser.add_argument("--gzip", action="store_true", help="gzip chunk answers")
    parser.add_argument("--meshes", metavar="DEST",
                        help="serve the meshes of a 'dvidshards meshes' output (default: meshes made on demand)")
    parser.add_argument("--index", metavar="FOLDER",
                        help="a label index, to find a body's chunks for its mesh or skeleton")
    parser.add_argument("--skeletons", metavar="DEST",
                        help="serve the skeletons of a 'dvidshards skeletons' output (default: made on demand)")
    parser.add_argument("--mesh-budget", type=float, default=2.0, metavar="SECONDS",
                        help="time an on-demand mesh should take: the finest scale that fits is meshed (default 2)")
    parser.add_argument("--no-viewer", action="store_true", help="only serve the precomputed source")


def main(args) -> int:
    """``dvidshards view``: print the source URL and the viewer URL, serve until Ctrl-C."""
    logging.basicConfig(level=logging.INFO, format="dvidshards view: %(levelname)s %(message)s")
    if not args.no_viewer:
        _neuroglancer()  # before any work
    ds = _as_dataset(args.source, args.spec)
    server = ViewServer(args.bind, args.port, gzip=args.gzip)
    try:
        src = server.add(ds, args.labels, meshes=args.meshes, mesh_budget=args.mesh_budget, skeletons=args.skeletons,
                         index=args.index)
        print(src, flush=True)
        if not args.no_viewer:
            v = _show(ds, src, select=args.select, position=args.position, image=args.image, bind=args.bind)
            print(f"viewer: {v.get_viewer_url()}", flush=True)
        server.wait(ready="serving; Ctrl-C to stop")
        return 0
    finally:
        server.close()
