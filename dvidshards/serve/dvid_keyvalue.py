"""Keyvalue instances of serve-dvid: a labelmap's meshes and skeletons, as FlyEM's DVIDs hold them.

neuroglancer's ``dvid://`` source shows meshes when the repo lists ``<labelmap>_meshes`` (keys
``<body>.ngmesh``: neuroglancer's legacy single-resolution mesh, float32 nm) and skeletons when
it lists ``<labelmap>_skeletons`` (keys ``<body>_swc``: SWC text in scale-0 voxels). Both are
answered with DVID's keyvalue read API (``keys``, ``keyrange/<a>/<b>``, ``key/<k>`` GET and HEAD,
``info``, ``tags``, ``help``; an absent body is 404). Values come from a ``dvidshards meshes
--legacy`` output when one is given, else they are made on demand from the body's chunks
(``Body.mesh``; ``Body.skeleton`` where the installed dvidshards has it) and cached, least
recently used dropped first.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from ..errors import NotFoundError, SpecError
from ..formats.labels import Agglomerated
from ..formats.mesh import Mesh
from ..formats.multilod import decode_legacy_fragment, encode_legacy_fragment
from .dvid_base import BadRequest, Gone, Reply, Request, json_reply, need

__all__ = ["KeyvalueInstance", "legacy_mesh_reader", "mesh_maker", "skeleton_maker"]

log = logging.getLogger("dvidshards.serve.dvid")

_MESH_CHUNKS = 512  # on-demand meshes: the finest held scale where the body spans at most this many chunks


class KeyvalueInstance:
    """A read-only keyvalue instance whose keys are ``<body><suffix>`` for the bodies of a labelmap.

    Parameters
    ----------
    name : str
    uuid : str
    labelmap : LabelmapInstance
        Whose bodies the keys name.
    suffix : str
        ``.ngmesh`` or ``_swc``.
    value : callable
        ``body -> bytes``, or NotFoundError when the body has no value.
    cache_bytes : int
        Values kept.
    """

    type_name = "keyvalue"

    def __init__(self, name: str, uuid: str, labelmap, suffix: str, value: Callable[[int], bytes], *,
                 cache_bytes: int = 256 << 20, what: str = ""):
        self.name, self.uuid, self.labelmap, self.suffix, self.value = name, uuid, labelmap, suffix, value
        self.what = what
        self.cache_bytes = int(cache_bytes)
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._cached = 0
        self._busy: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self._key = re.compile(r"^([0-9]{1,20})" + re.escape(suffix) + "$")
        self.routes = {"help": self.ep_help, "info": self.ep_info, "tags": self.ep_tags, "keys": self.ep_keys,
                       "keyrange": self.ep_keyrange, "key": self.ep_key, "mutations": self.ep_empty,
                       "mutations-range": self.ep_empty}

    def quick(self, endpoint: str, r: Request) -> bool:
        m = self._key.match("/".join(r.args)) if endpoint == "key" and not r.head else None
        return endpoint in ("help", "info", "tags", "mutations", "mutations-range") or (
            m is not None and int(m.group(1)) in self._cache)

    def is_write(self, endpoint: str, method: str) -> bool:
        return method not in ("GET", "HEAD")

    def base(self) -> dict:
        return {"TypeName": "keyvalue", "TypeURL": "github.com/janelia-flyem/dvid/datatype/keyvalue",
                "TypeVersion": "0.1", "DataUUID": self.uuid, "Name": self.name, "RepoUUID": self.uuid,
                "Compression": "", "Checksum": "No checksum", "Syncs": [self.labelmap.name], "Versioned": True,
                "KVStore": self.what, "LogStore": "no mutation log set", "Tags": {}}

    def info(self) -> dict:
        return {"Base": self.base(), "Extended": {}}

    def ep_info(self, r: Request) -> Reply:
        return json_reply(self.info())

    def ep_help(self, r: Request) -> Reply:
        return Reply(200, (__doc__ or "").encode(), "text/plain")

    def ep_tags(self, r: Request) -> Reply:
        return Reply(200, b'{"Tags":{}}')

    def ep_empty(self, r: Request) -> Reply:
        return Reply(200, b"[]")

    def _keys(self) -> list[str]:
        bodies, _ = self.labelmap._all_bodies(False)
        return sorted(f"{int(b)}{self.suffix}" for b in bodies.tolist())

    def ep_keys(self, r: Request) -> Reply:
        return json_reply(self._keys())

    def ep_keyrange(self, r: Request) -> Reply:
        need(r.args, 2, "<key1>/<key2>")
        a, b = r.args[0], r.args[1]
        return json_reply([k for k in self._keys() if a <= k <= b])

    def ep_key(self, r: Request) -> Reply:
        need(r.args, 1, "a key")
        key = "/".join(r.args)
        m = self._key.match(key)
        if m is None or not 0 < int(m.group(1)) < 1 << 64:
            raise Gone(f'Key "{key}" not found')
        body = int(m.group(1))
        if r.head:  # DVID: 200 when the key exists (the body does), else 404; nothing is made
            b, _ = self.labelmap._body(body, self.labelmap.held[0], Agglomerated())
            if not b.exists():
                raise Gone(f'Key "{key}" not found')
            return Reply(200, b"", "application/octet-stream", {"Accept-Ranges": "bytes"})
        try:
            data = self.get(body)
        except NotFoundError:
            raise Gone(f'Key "{key}" not found') from None
        return Reply(200, data, "application/octet-stream", {"Accept-Ranges": "bytes"})

    def get(self, body: int) -> bytes:
        """A body's value, made once (one request makes it, the others wait) and cached."""
        while True:
            with self._lock:
                data = self._cache.get(body)
                if data is not None:
                    self._cache.move_to_end(body)
                    return data
                ev = self._busy.get(body)
                if ev is None:
                    ev = self._busy[body] = threading.Event()
                    break
            ev.wait()
        try:
            data = self.value(body)
            with self._lock:
                self._cache[body] = data
                self._cached += len(data)
                while self._cached > self.cache_bytes and len(self._cache) > 1:
                    _, old = self._cache.popitem(last=False)
                    self._cached -= len(old)
            return data
        finally:
            with self._lock:
                self._busy.pop(body, None)
            ev.set()


# --------------------------------------------------------------------------- values


def mesh_maker(labelmap) -> Callable[[int], bytes]:
    """Meshes on demand: the body's chunks at the finest held scale where it spans at most
    ``_MESH_CHUNKS`` chunks (else the coarsest held), meshed (``Body.mesh``), in nm."""

    def make(body: int) -> bytes:
        held = labelmap.held
        b, _ = labelmap._body(body, held[0], Agglomerated())
        if not b.exists():
            raise NotFoundError(f"body {body} does not exist in this export")
        k = held[-1]
        for s in held:
            if len(b.chunks_at(s)) <= _MESH_CHUNKS:
                k = s
                break
        chunks = b.chunks_at(k)
        mesh = b.mesh(k, units="nm", chunks=chunks)
        log.info("mesh of body %d: scale %d, %d chunks, %d triangles", body, k, len(chunks), len(mesh.faces))
        return encode_legacy_fragment(mesh)

    return make


def skeleton_maker(labelmap) -> Callable[[int], bytes] | None:
    """Skeletons on demand when the installed dvidshards makes them (``Body.skeleton``): SWC text
    in scale-0 voxels with DVID's ``{"mutation id": 0}`` comment; None otherwise."""
    from ..bodies import Body

    if not hasattr(Body, "skeleton"):
        return None

    def make(body: int) -> bytes:
        b, _ = labelmap._body(body, labelmap.held[0], Agglomerated())
        if not b.exists():
            raise NotFoundError(f"body {body} does not exist in this export")
        sk = b.skeleton()
        text = sk.swc() if hasattr(sk, "swc") else str(sk)
        return ('# {"mutation id": 0}\n' + text).encode()

    return make


def legacy_mesh_reader(folder: str) -> Callable[[int], bytes]:
    """Meshes read from a legacy meshes output (``dvidshards meshes --legacy``): a body's
    fragments (``<id>:0`` lists them) joined into one ngmesh."""
    root = os.path.abspath(folder)
    info_path = os.path.join(root, "info")
    try:
        with open(info_path) as f:
            info = json.load(f)
    except (OSError, ValueError) as e:
        raise SpecError(f"{folder}: not a meshes output (cannot read its info: {e})") from None
    mesh_dir = root
    if info.get("@type") != "neuroglancer_legacy_mesh":
        sub = info.get("mesh")
        if not isinstance(sub, str):
            raise SpecError(f"{folder}: its info names no mesh directory and is not a legacy mesh info")
        mesh_dir = os.path.join(root, sub)
        try:
            with open(os.path.join(mesh_dir, "info")) as f:
                minfo = json.load(f)
        except (OSError, ValueError) as e:
            raise SpecError(f"{mesh_dir}: cannot read the mesh info ({e})") from None
        if minfo.get("@type") != "neuroglancer_legacy_mesh":
            raise BadRequest(f"{mesh_dir}: a multi-resolution meshes output ({minfo.get('@type')}); serve-dvid "
                             f"serves legacy meshes (dvidshards meshes --legacy), neuroglancer reads this one "
                             f"through dvidshards view --meshes")

    def read(body: int) -> bytes:
        try:
            with open(os.path.join(mesh_dir, f"{body}:0")) as f:
                names = json.load(f).get("fragments", [])
        except FileNotFoundError:
            raise NotFoundError(f"no mesh of body {body} in {mesh_dir}") from None
        parts = []
        for n in names:
            with open(os.path.join(mesh_dir, os.path.basename(n)), "rb") as f:
                parts.append(decode_legacy_fragment(f.read()))
        if len(parts) == 1:
            return encode_legacy_fragment(parts[0])
        off = np.cumsum([0] + [len(p.vertices) for p in parts[:-1]])
        joined = Mesh(np.concatenate([p.vertices for p in parts]).astype(np.float32),
                      np.concatenate([p.faces + o for p, o in zip(parts, off, strict=True)]).astype(np.uint32))
        return encode_legacy_fragment(joined)

    return read
