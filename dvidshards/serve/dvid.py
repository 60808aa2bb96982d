"""DVID's read-only HTTP API over exports: ``dvidshards serve-dvid`` and `serve`.

FlyEM's tools read segmentation through DVID: neuroglancer's ``dvid://`` source, neuclease's
``fetch_*``, dvidtools, flyemflows, small clients such as ``dvid-point-cloud``. This server
answers them from exports alone, with the request parameters and response bytes of DVID's help
texts (``datatype/labelmap/labelmap.go``, ``datatype/keyvalue/keyvalue.go``, ``server/web.go``)::

    dvidshards serve-dvid EXPORT                       one node (uuid: a hash of where EXPORT is),
                                                       instance "segmentation" (--instance NAME)
    dvidshards serve-dvid A B                          A and B as two nodes (two repos), each with
                                                       its "segmentation" (--uuid U1 U2 to name them)
    dvidshards serve-dvid seg=A other=B                one node holding instances "seg" and "other"
    ... --label-index IDX   --meshes OUT   --skeletons OUT    one per export, in order ('-': none)
    ... --spec SPEC  --strict  --host H  --port P  --threads N  --reuse-port

EXPORT is a folder, a gs:// s3:// http(s):// URL, or a ``downsample`` output (read with the
export it was made from, as one pyramid). Each labelmap instance ``<name>`` comes with keyvalue
instances ``<name>_meshes`` (``<body>.ngmesh``) and, where skeletons can be had,
``<name>_skeletons`` (``<body>_swc``): made on demand and cached, or read from the output given.

Server and repos, as DVID answers them (CORS on every answer)::

    GET /api/server/info                    "DVID Version" (the API followed), cores, mode
    GET /api/repos/info                     every repo: Alias, DAG, DataInstances (Base, Extended)
    GET /api/repo/<uuid>/info   /api/repo/<uuid>/branch-versions/<branch>   /api/repo/<uuid>/log
    GET /api/node/<uuid>/info   .../note   .../log   .../commit   .../status

A labelmap instance (``/api/node/<uuid>/<instance>/...``; uuid: a unique prefix, or ``<uuid>:master``)::

    info  help  tags  metadata  map-stats  maxlabel  nextlabel
    label/<x_y_z>  labels (JSON body)                  ids at points (0 outside the volume)
    raw|isotropic/<dims>/<size>/<offset>[/<format>]    0_1_2: uint64 z,y,x, compression=gzip|lz4|google|
                                                       googlegzip; xy|xz|yz: png or jpg[:quality]
    blocks/<size>/<offset>  specificblocks?blocks=     compression=blocks|gzip|uncompressed|lz4
    sparsevol/<label> (GET, HEAD)  sparsevol-by-point/<x_y_z>  sparsevol-size/<label>
    sparsevol-coarse/<label>  sparsevols-coarse/<a>/<b>
    size/<label>  sizes  supervoxels/<label>  supervoxel-sizes/<label>  lastmod/<label>
    index/<label>  indices (GET, JSON body)  index-version/<label>  listlabels  existing-labels
    mapping (JSON body)  mappings[?format=binary]
    mutations  mutations-range/<a>/<b>  history/<label>/<a>/<b>  supervoxel-splits  proximity/<a>/<b>

Every read takes ``scale`` (any scale of the spec from the finest the export holds up: the
export's own, else made on demand by DVID's rule and cached) and ``supervoxels=true``; query
parameters DVID ignores (``u``, ``app``, ``admintoken``, ...) are ignored. A write answers 405
with one line; an absent body 404; a bad parameter 400 naming it; what an export cannot answer
one line saying why. Voxels DVID never wrote are 0: outside the volume, and in a shard file
absent inside it (``--strict``: a 500 naming the file). A streamed answer (blocks, sparse
volumes, mappings) is made whole before its status is sent (spooled to disk above 16 MiB), so
a failure is always a clean error, never a cut answer.

Where the bytes differ from DVID's, because an export does not define them: blocks come in
(z, y, x) order; runs DVID writes in Go map order are sorted; compressed_segmentation tables are
sorted (TensorStore's encoder); ``maxlabel`` is the largest id of the records' lists;
``lastmod`` says mutation id 0 and the export's time; ``sizes``/``size`` and other body
endpoints also take ``scale`` (DVID: scale 0).

Each process opens the exports itself and keeps only caches (shards, made blocks, meshes), so
any number of processes can serve one export (``--reuse-port``). aiohttp and lz4 are optional
(``pip install dvidshards[serve]``).
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.util
import logging
import os
import re
import sys
import tempfile
import threading
import time as _time
from dataclasses import dataclass, field
from typing import Any

from ..dataset import Dataset
from ..errors import DvidShardsError, MissingShardError, NotFoundError, SpecError
from ..query import BodyIndex, held_scales
from .dvid_base import MAX_BODY, READ_ONLY, BadRequest, Reply, Request, json_reply, text_reply
from .dvid_keyvalue import KeyvalueInstance
from .dvid_labelmap import LabelmapInstance
from .meshes import MeshSource, SkeletonSource

__all__ = ["DvidCommand", "DvidServer", "Node", "ReadOnly", "add_arguments", "main", "serve"]

log = logging.getLogger("dvidshards.serve.dvid")

DVID_VERSION = "v1.0.0"  # the DVID release whose API this server follows
DATASTORE_VERSION = "0.11.0"
_SPOOL = 16 << 20  # a streamed answer past this goes to a temporary file


class ReadOnly(DvidShardsError):
    """A write to this read-only server (answered 405)."""


ERRORS: dict[type[BaseException], int] = {BadRequest: 400, SpecError: 400, NotFoundError: 404, ReadOnly: 405, MissingShardError: 500,
          DvidShardsError: 500}


# --------------------------------------------------------------------------- nodes


@dataclass
class Node:
    """One version node (its own repo): its uuid and instances."""

    uuid: str
    alias: str
    description: str
    time: str
    instances: dict = field(default_factory=dict)
    builders: list = field(default_factory=list)  # (thread, stop) of the supervoxel tables built at start

    def node_json(self) -> dict:
        return {"Branch": "", "Note": "", "Log": [], "UUID": self.uuid, "VersionID": 1, "Locked": True,
                "Parents": [], "Children": [], "Created": self.time, "Updated": self.time}

    def repo_json(self) -> dict:
        return {"Root": self.uuid, "Alias": self.alias, "Description": self.description, "Log": [],
                "Properties": {}, "DataInstances": {n: i.info() for n, i in self.instances.items()},
                "DAG": {"Root": self.uuid, "Nodes": {self.uuid: self.node_json()}}, "MutationID": 0,
                "SavedMutationID": 0, "Created": self.time, "Updated": self.time}


def _time_of(ds: Dataset, held: list[int]) -> str:
    """The export's time (RFC 3339, UTC): its finest held scale folder's modification time."""
    local = getattr(ds.store, "local_path", None)
    path = local(ds.scale(held[0]).folder) if local is not None else None
    try:
        t = os.stat(path).st_mtime if path else None
    except OSError:
        t = None
    if t is None:
        return "0001-01-01T00:00:00Z"
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def default_uuid(*locations: str) -> str:
    """A node uuid: the same in every process serving the same exports (a hash of where they are)."""
    return hashlib.sha256("\n".join(locations).encode()).hexdigest()[:32]


def _check_name(instance: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", instance or ""):
        raise SpecError(f"instance {instance!r}: give a name of letters, digits, '_', '.' or '-'")
    return instance


def _check_uuid(uuid: str) -> str:
    if not re.fullmatch(r"[0-9a-fA-F]{4,32}", uuid or ""):
        raise SpecError(f"uuid {uuid!r}: give 4 to 32 hexadecimal digits, as DVID's")
    return uuid.lower()


def _instances(node: Node, name: str, ds: Dataset, *, index=None, meshes=None, skeletons=None,
               strict: bool = False) -> LabelmapInstance:
    """A labelmap instance of an export in a node, with its keyvalue instances."""
    held = held_scales(ds)
    if not held:
        raise SpecError(f"{ds.store.describe('')}: the export holds no scale with shard files")
    idx = None if index is None else index if isinstance(index, BodyIndex) else BodyIndex(index)
    if idx is not None and idx.meta.get("box"):
        raise SpecError(f"{idx.path}: a label index of the box {idx.meta['box']} would answer every body as its part "
                        f"inside it; make one of the whole scale (label-index without --box) or serve without it")
    lm = LabelmapInstance(ds, _check_name(name), node.uuid, held, index=idx, fill=not strict,
                          time=_time_of(ds, held), describe=ds.store.describe(""))
    node.instances[name] = lm
    if idx is not None and idx.scale == held[0] and idx.meta.get("labels") == "agglomerated":  # now, not at 1st use
        stop = threading.Event()
        th = threading.Thread(target=_build_table, args=(lm, idx, stop), name=f"serve-dvid {name}: supervoxel table",
                              daemon=True)
        node.builders.append((th, stop))
        th.start()
    bodies_index = idx if idx is not None and idx.meta.get("labels") == "agglomerated" else None
    mesh = MeshSource(ds, meshes=meshes, index=bodies_index)
    node.instances[f"{name}_meshes"] = KeyvalueInstance(
        f"{name}_meshes", node.uuid, lm, ".ngmesh", mesh.get, mesh.cached,
        what=f"meshes of {name}: " + (str(mesh.output) if meshes is not None else "made on demand"))
    if skeletons is not None or importlib.util.find_spec("kimimaro") is not None:  # else none to be had
        sk = SkeletonSource(ds, skeletons=skeletons, index=bodies_index)
        node.instances[f"{name}_skeletons"] = KeyvalueInstance(
            f"{name}_skeletons", node.uuid, lm, "_swc", sk.swc, sk.cached,
            what=f"skeletons of {name}: " + (str(sk.output) if skeletons is not None else "made on demand"))
    return lm


def _build_table(lm: LabelmapInstance, idx: BodyIndex, stop: threading.Event) -> None:
    try:
        idx.supervoxel_table(stop=stop)  # stops at the server's shutdown: no thread left in pyarrow at exit
    except Exception:  # the request that needs it raises it again
        log.exception("%s: building the supervoxel table", lm.name)


# --------------------------------------------------------------------------- the HTTP server


class DvidServer:
    """Nodes served over HTTP (`serve` makes one and starts it).

    Attributes
    ----------
    url : str
        ``http://host:port`` it listens on.
    nodes : list of Node
    api : LabelmapInstance
        The first labelmap instance (``api.uuid``, ``api.name``, ``api.ds``, ``api.index``).
    """

    def __init__(self, nodes: list[Node], *, host: str = "127.0.0.1", port: int = 8000, threads: int | None = None,
                 reuse_port: bool = False):
        from . import http

        self.nodes = nodes
        self.threads = int(threads or min(8, os.cpu_count() or 2))
        if self.threads < 1:
            raise SpecError("threads must be at least 1")
        self.started = _time.time()
        self.api = next(i for n in nodes for i in n.instances.values() if isinstance(i, LabelmapInstance))
        app = http.application(self._routes(), errors=ERRORS, logger=log, threads=self.threads,
                               in_flight=2 * self.threads, client_max_size=MAX_BODY)
        self.server = http.Server(app, host=host, port=port, reuse_port=reuse_port, name="serve-dvid")
        self.url = self.server.url
        self.host, self.port = self.server.host, self.server.port

    # --- nodes --------------------------------------------------------------------------------

    def node(self, text: str) -> Node:
        """The node a uuid names: a unique prefix, or ``<prefix>:master``."""
        u, _, branch = text.partition(":")
        if branch not in ("", "master"):
            raise BadRequest(f"uuid {text!r}: this server's nodes have one branch, master")
        u = u.lower()
        hits = [n for n in self.nodes if u and n.uuid.startswith(u)]
        if len(hits) != 1:
            have = ", ".join(n.uuid for n in self.nodes)
            raise BadRequest(f"uuid {text!r}: {'matches ' + str(len(hits)) + ' nodes' if hits else 'no node'}; "
                             f"this server holds {have}")
        return hits[0]

    def instance(self, uuid: str, name: str):
        node = self.node(uuid)
        inst = node.instances.get(name)
        if inst is None:
            raise NotFoundError(f"no data instance {name!r} in node {node.uuid}: it holds "
                                f"{', '.join(sorted(node.instances))}")
        return inst

    # --- answers ------------------------------------------------------------------------------

    def server_info(self) -> dict:
        up = _time.time() - self.started
        return {"Cores": str(self.threads), "Maximum Cores": str(os.cpu_count() or 1),
                "Datastore Version": DATASTORE_VERSION, "DVID Version": DVID_VERSION,
                "Storage backend": "dvidshards exports (read-only)", "Server time": _now(),
                "Server uptime": f"{up:.3f}s", "RPC Address": "", "Host": f"{self.host}:{self.port}",
                "Note": "dvidshards serve-dvid: DVID's read API over exports", "TOML location": "",
                "Mode": "read only"}

    def _routes(self):
        from aiohttp import web

        plain = {
            "server/info": lambda p: json_reply(self.server_info()),
            "repos/info": lambda p: json_reply({n.uuid: n.repo_json() for n in self.nodes}),
            "repo/info": lambda p: json_reply(self.node(p["uuid"]).repo_json()),
            "repo/log": lambda p: (self.node(p["uuid"]), json_reply({"log": []}))[1],
            "repo/branch-versions": lambda p: json_reply(
                [self.node(p["uuid"]).uuid] if p["branch"] in ("master", "") else []),
            "node/info": lambda p: json_reply(self.node(p["uuid"]).node_json()),
            "node/note": lambda p: (self.node(p["uuid"]), json_reply({"note": ""}))[1],
            "node/log": lambda p: (self.node(p["uuid"]), json_reply({"log": []}))[1],
            "node/commit": lambda p: (self.node(p["uuid"]), Reply(200, b'{"Locked":true}'))[1],
            "node/status": lambda p: (self.node(p["uuid"]), Reply(200, b'{"Locked":true}'))[1],
        }

        def plain_handler(key: str):
            async def handle(request):
                if request.method not in ("GET", "HEAD"):
                    raise ReadOnly(READ_ONLY)
                return _response(plain[key](dict(request.match_info)))
            return handle

        rows = [web.route("*", "/api/server/info", plain_handler("server/info")),
                web.route("*", "/api/server/info/", plain_handler("server/info")),
                web.route("*", "/api/repos/info", plain_handler("repos/info")),
                web.route("*", "/api/repo/{uuid}/info", plain_handler("repo/info")),
                web.route("*", "/api/repo/{uuid}/log", plain_handler("repo/log")),
                web.route("*", "/api/repo/{uuid}/branch-versions/{branch}", plain_handler("repo/branch-versions"))]
        for action in ("info", "note", "log", "commit", "status"):
            rows.append(web.route("*", f"/api/node/{{uuid}}/{action}", plain_handler(f"node/{action}")))
        rows.append(web.route("*", "/api/node/{uuid}/{instance}/{endpoint}{tail:(/.*)?}", self._instance_handler))
        rows.append(web.route("*", "/{tail:.*}", self._not_found))
        return rows

    async def _not_found(self, request):
        if request.method not in ("GET", "HEAD"):
            raise ReadOnly(READ_ONLY)
        return _response(text_reply(f"Could not find the URL: {request.path} (this server answers /api/server/info, "
                                    f"/api/repos/info, /api/repo/<uuid>/..., /api/node/<uuid>/<instance>/...)", 404))

    async def _instance_handler(self, request):
        from . import http

        p = request.match_info
        inst = self.instance(p["uuid"], p["instance"])
        ep = p["endpoint"]
        handler = inst.routes.get(ep)
        if inst.is_write(ep, request.method):
            raise ReadOnly(READ_ONLY)
        if handler is None:
            raise BadRequest(f"unrecognized API call {ep!r} for {inst.type_name} data {inst.name!r} (see "
                             f"/api/node/{inst.uuid}/{inst.name}/help)")
        body = await request.read() if request.can_read_body else b""
        tail = p["tail"]
        req = Request(request.method, tail.split("/")[1:] if tail else [], dict(request.query), body)
        if inst.quick(ep, req):  # in memory: a hop to the pool would cost more than the answer
            return _response(_answer(handler, req))
        return _response(await http.in_thread(request, _answer, handler, req))

    # --- lifetime -----------------------------------------------------------------------------

    def start(self) -> DvidServer:
        self.server.start()
        return self

    def shutdown(self) -> None:
        """Stop answering and release the port and the threads."""
        self.server.close()
        for node in self.nodes:
            for _, stop in node.builders:
                stop.set()
            for th, _ in node.builders:
                th.join()  # it stops after the index bucket it reads

    close = shutdown

    def wait(self, **ready: Any) -> None:
        """Serve until Ctrl-C, then stop (``ready``: see `http.Server.wait`)."""
        self.server.wait(**ready)

    def __enter__(self) -> DvidServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"DvidServer({self.url}, nodes {[n.uuid for n in self.nodes]})"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f +0000 UTC")


def _answer(handler, req: Request) -> Reply:
    """A handler's reply, its stream made whole before anything is sent: bytes, or a temporary
    file past ``_SPOOL`` bytes (aiohttp sends it and closes it)."""
    try:
        reply = handler(req)
    except MissingShardError as e:  # only with --strict: say what the default does
        raise MissingShardError(f"{e} [serve-dvid --strict; without it a shard file DVID never wrote reads as "
                                f"background, as DVID answers]") from None
    if reply.stream is None:
        return reply
    buf, f = bytearray(), None
    try:
        for piece in reply.stream:
            if f is None and len(buf) + len(piece) > _SPOOL:
                f = tempfile.TemporaryFile()
                f.write(buf)
            if f is None:
                buf += piece
            else:
                f.write(piece)
    except BaseException:
        if f is not None:
            f.close()
        raise
    finally:
        close = getattr(reply.stream, "close", None)
        if close is not None:
            close()
    if f is not None:
        f.seek(0)
    reply.body, reply.stream = bytes(buf) if f is None else f, None
    return reply


def _response(reply: Reply):
    from aiohttp import web

    return web.Response(status=reply.status, body=reply.body, content_type=reply.content_type,
                        headers=reply.headers)


# --------------------------------------------------------------------------- serve


def serve(exports, *, spec=None, label_index=None, meshes=None, skeletons=None, host: str = "127.0.0.1",
          port: int = 8000, uuid=None, instance: str = "segmentation", threads: int | None = None,
          strict: bool = False, reuse_port: bool = False) -> DvidServer:
    """Serve exports as DVID's read-only API; returns the running `DvidServer`.

    Parameters
    ----------
    exports : str, path, URL, Dataset, a list of them, or {instance name: export}
        One export; several, each its own node; or a mapping, one node holding each export as
        the named instance.
    spec : dict or path, optional
        The neuroglancer multiscale spec (see ``Dataset``), for every export.
    label_index, meshes, skeletons : path or list of paths, optional
        A label index (``dvidshards label-index``), a meshes output (``dvidshards meshes``, either
        format), a skeletons output: one, or one per export (None: none).
    host, port :
        Where to listen (port 0: any free port; ``server.url`` says which).
    uuid : str or list of str, optional
        The node uuid(s) (default: a hash of the exports' locations, the same in every process).
    instance : str
        The labelmap instance name of exports given without one (default ``segmentation``).
    threads : int, optional
        Decoding threads (default: the cores, at most 8); ``2 x threads`` requests are worked
        on at a time, the others wait.
    strict : bool
        Answer a missing shard file inside the volume with 500 naming it (default: background,
        as DVID answers blocks it never wrote).
    reuse_port : bool
        Let other processes listen on the same port (SO_REUSEPORT).

    Examples
    --------
    >>> server = serve("export/", spec="mcns-ng-specs.json", port=0)   # doctest: +SKIP
    >>> requests.get(f"{server.url}/api/node/{server.api.uuid}/segmentation/sparsevol-size/123").json()
    """
    named = isinstance(exports, dict)
    items = list(exports.items()) if named else [(None, e) for e in
                                                  (exports if isinstance(exports, (list, tuple)) else [exports])]
    if not items:
        raise SpecError("give at least one export")
    n = len(items)

    def per(value, what: str) -> list:
        vals = list(value) if isinstance(value, (list, tuple)) else [value] * (1 if n == 1 or value is None else 0)
        if value is None:
            return [None] * n
        if len(vals) != n:
            raise SpecError(f"{what}: give one per export ({n}), '-' for none; got {len(vals)}")
        return [None if v in (None, "-") else v for v in vals]

    indexes, meshes_, skels = per(label_index, "--label-index"), per(meshes, "--meshes"), per(skeletons,
                                                                                              "--skeletons")
    dss = [e if isinstance(e, Dataset) else Dataset(e, spec=spec) for _, e in items]
    where = [ds.store.describe("") for ds in dss]
    uuids = [uuid] if isinstance(uuid, str) else list(uuid or [])
    nodes: list[Node] = []
    if named:
        if len(uuids) > 1:
            raise SpecError(f"--uuid: named instances share one node; give one uuid, got {len(uuids)}")
        node = Node(_check_uuid(uuids[0]) if uuids else default_uuid(*where), "dvidshards",
                    "dvidshards exports " + ", ".join(where) + " (read-only)", "")
        nodes.append(node)
        for (name, _), ds, i, m, s in zip(items, dss, indexes, meshes_, skels, strict=True):
            _instances(node, str(name), ds, index=i, meshes=m, skeletons=s, strict=strict)
    else:
        if uuids and len(uuids) != n:
            raise SpecError(f"--uuid: give one per export ({n}), got {len(uuids)}")
        for j, (ds, i, m, s) in enumerate(zip(dss, indexes, meshes_, skels, strict=True)):
            u = _check_uuid(uuids[j]) if uuids else default_uuid(where[j])
            node = Node(u, os.path.basename(where[j].rstrip("/")) or where[j], f"dvidshards export {where[j]} "
                        "(read-only)", "")
            nodes.append(node)
            _instances(node, instance, ds, index=i, meshes=m, skeletons=s, strict=strict)
    if len({n.uuid for n in nodes}) != len(nodes):
        raise SpecError("two exports have the same uuid: give --uuid for each")
    for node in nodes:
        node.time = max(i.time for i in node.instances.values() if isinstance(i, LabelmapInstance))
    return DvidServer(nodes, host=host, port=port, threads=threads, reuse_port=reuse_port).start()


# --------------------------------------------------------------------------- command line


def add_arguments(p) -> None:
    """Arguments of ``dvidshards serve-dvid``."""
    p.add_argument("exports", nargs="+", metavar="[NAME=]EXPORT",
                   help="exports (folder, gs://, s3://, http(s):// URL, or a downsample output): each its own node, "
                        "or NAME=EXPORT for instances of one node")
    p.add_argument("--spec", help="the neuroglancer multiscale spec given to DVID's export-shards")
    p.add_argument("--label-index", action="append", metavar="DIR",
                   help="a label index (dvidshards label-index), one per export in order ('-': none)")
    p.add_argument("--meshes", action="append", metavar="DIR",
                   help="a meshes output (dvidshards meshes), one per export ('-': none; "
                        "default: meshes made on demand)")
    p.add_argument("--skeletons", action="append", metavar="DIR",
                   help="a skeletons output (dvidshards skeletons), one per export ('-': none; default: made on demand "
                        "where kimimaro is installed)")
    p.add_argument("--uuid", nargs="+", help="node uuid(s): one per export, or one for NAME=EXPORT instances "
                                             "(default: a hash of the exports' locations)")
    p.add_argument("--instance", default="segmentation", help="labelmap instance name (default segmentation)")
    missing = p.add_mutually_exclusive_group()
    missing.add_argument("--fill-missing-shards", action="store_false", dest="strict",
                         help="a shard file missing inside the volume reads as background, as DVID answers blocks "
                              "it never wrote (the default)")
    missing.add_argument("--strict", action="store_true",
                         help="answer a shard file missing inside the volume with 500 naming it")
    p.set_defaults(strict=False)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port, printed)")
    p.add_argument("--threads", type=int, default=None, help="decoding threads (default: cores, at most 8)")
    p.add_argument("--reuse-port", action="store_true",
                   help="let several serve-dvid processes listen on this port (SO_REUSEPORT)")


def main(args) -> int:
    """Run ``dvidshards serve-dvid``: print each labelmap's URL, then serve until interrupted."""
    named = [re.fullmatch(r"([A-Za-z0-9_.-]+)=(.+)", e) for e in args.exports]
    if any(named) and not all(named):
        raise SpecError("give every export as NAME=EXPORT (instances of one node) or none (one node each)")
    exports = {m.group(1): m.group(2) for m in named if m} if all(named) else list(args.exports)
    if isinstance(exports, dict) and len(exports) != len(args.exports):
        raise SpecError("two exports have the same instance name")
    def one(v):
        return (v[0] if v and len(v) == 1 else v)
    server = serve(exports if len(args.exports) > 1 or isinstance(exports, dict) else exports[0],
                   spec=args.spec, label_index=one(args.label_index), meshes=one(args.meshes),
                   skeletons=one(args.skeletons), host=args.host, port=args.port,
                   uuid=args.uuid[0] if args.uuid and len(args.uuid) == 1 else args.uuid, instance=args.instance,
                   threads=args.threads, strict=args.strict, reuse_port=args.reuse_port)
    for node in server.nodes:
        for inst in node.instances.values():
            if isinstance(inst, LabelmapInstance):
                print(f"{server.url}/api/node/{node.uuid}/{inst.name}", flush=True)
                idx = f", label index {inst.index.path}" if inst.index is not None else ""
                print(f"serving {inst.describe} as DVID node {node.uuid}, instance {inst.name}, scales "
                      f"{inst.held} (serving 0..{inst.pyramid.max_level}){idx}; neuroglancer: "
                      f"dvid://{server.url}/{node.uuid}/{inst.name}", file=sys.stderr, flush=True)
    server.wait(ready="(Ctrl-C to stop)", file=sys.stderr)
    return 0


class DvidCommand:
    """``dvidshards serve-dvid``: one row of ``cli.COMMANDS``."""

    add_arguments = staticmethod(add_arguments)
    main = staticmethod(main)
