"""Keyvalue instances of serve-dvid: a labelmap's meshes and skeletons, as FlyEM's DVIDs hold them.

neuroglancer's ``dvid://`` source shows meshes when the repo lists ``<labelmap>_meshes`` (keys
``<body>.ngmesh``: neuroglancer's legacy single-resolution mesh, float32 nm) and skeletons when
it lists ``<labelmap>_skeletons`` (keys ``<body>_swc``: SWC text). Both are answered with DVID's
keyvalue read API (``keys``, ``keyrange/<a>/<b>``, ``key/<k>`` GET and HEAD, ``info``, ``tags``,
``help``; an absent body is 404). Values come from a source (`dvidshards.serve.meshes`): read
from an output given, or made on demand and cached.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from ..errors import NotFoundError
from ..formats.labels import Agglomerated
from .dvid_base import Gone, Reply, Request, json_reply, need

__all__ = ["KeyvalueInstance"]


class KeyvalueInstance:
    """A read-only keyvalue instance whose keys are ``<body><suffix>`` for the bodies of a labelmap:
    ``value(body)`` (NotFoundError when it has none), ``cached(body)`` whether it is in memory."""

    type_name = "keyvalue"

    def __init__(self, name: str, uuid: str, labelmap, suffix: str, value: Callable[[int], bytes],
                 cached: Callable[[int], bool], *, what: str = ""):
        self.name, self.uuid, self.labelmap, self.suffix, self.what = name, uuid, labelmap, suffix, what
        self.value, self.cached = value, cached
        self._key = re.compile(r"^([0-9]{1,20})" + re.escape(suffix) + "$")
        self.routes = {"help": self.ep_help, "info": self.ep_info, "tags": self.ep_tags, "keys": self.ep_keys,
                       "keyrange": self.ep_keyrange, "key": self.ep_key, "mutations": self.ep_empty,
                       "mutations-range": self.ep_empty}

    def quick(self, endpoint: str, r: Request) -> bool:
        m = self._key.match("/".join(r.args)) if endpoint == "key" and not r.head else None
        return endpoint in ("help", "info", "tags", "mutations", "mutations-range") or (
            m is not None and self.cached(int(m.group(1))))

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
            data = self.value(body)
        except NotFoundError:
            raise Gone(f'Key "{key}" not found') from None
        return Reply(200, data, "application/octet-stream", {"Accept-Ranges": "bytes"})
