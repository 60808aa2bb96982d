"""A pyramid in several roots: an export and the scales ``dvidshards downsample`` made for it.

A downsample output's manifest names the export it was made from: its URL, its path relative to
the output (the two can be moved or uploaded together) and the sizes of the shard files the
scales were made from (:func:`source_identity`). Opened alone, the output finds the export where
the relative path leads, else at its URL, and checks a sample of those sizes; a source that
changed since is a SpecError (read together they would mix two exports). :class:`LayeredStore`
reads the roots as one export, each scale from its root.
"""

from __future__ import annotations

import asyncio
import builtins
import hashlib
import os
import posixpath
import re
from collections.abc import Iterable
from typing import Any

from .errors import MissingShardError, RemoteReadError, SpecError
from .formats.multiscale import Scale, parse_json
from .scalefiles import scales_phrase
from .stores import ByteStore, Stat, as_store

__all__ = ["ABSENT", "MANIFEST", "LayeredStore", "Layer", "check_source", "downsample_manifest", "drive_all",
           "given_roots", "identity_changes", "mixed_error", "parse_manifest", "present_scales", "roots_of",
           "shard_sizes", "source_identity"]

MANIFEST = "_dvidshards.json"  # a job's manifest at the root of its output (``jobs.output`` writes it)
_SCALE_KEY = re.compile(r"s([0-9]+)(?:/|$)")
_PRESENCE_GROUP = 4  # scale folders listed together, coarse to fine, on stores where a listing waits
ABSENT = "absent"  # check_source: the roots hold none of the files the scales were made from
_SAMPLE = 16  # shard files of a downsample output's source whose sizes an open checks
#: a root, the scales it is known to hold (None: found by listing) and its downsample manifest
Layer = tuple[ByteStore, "frozenset[int] | None", "dict | None"]


class LayeredStore(ByteStore):
    """Several export roots read as one: scale ``k``'s keys (``s{k}/...``) from the root ``route``
    gives it, other keys (``info``) from the first root holding them; each file keeps its own
    path (``describe``)."""

    def __init__(self, stores: Iterable[ByteStore], route: dict[int, int] | None = None):
        self.stores = list(stores)
        self.route: dict[int, int] = dict(route or {})
        self.mappable = all(st.mappable for st in self.stores)
        self.immediate = all(st.immediate for st in self.stores)

    @property
    def base(self) -> ByteStore:
        """The first root (the source export): what a message's suggested commands start from."""
        return self.stores[0]

    def __reduce__(self) -> tuple[Any, ...]:
        return (LayeredStore, (self.stores, self.route))

    def __repr__(self) -> str:
        return f"LayeredStore({self.stores!r}, route={self.route!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LayeredStore) and other.stores == self.stores and other.route == self.route

    def __hash__(self) -> int:
        return hash((tuple(id(st) for st in self.stores), tuple(sorted(self.route.items()))))

    def _of(self, key: str) -> ByteStore | None:
        m = _SCALE_KEY.match(key)
        return None if m is None else self.stores[self.route.get(int(m.group(1)), 0)]

    def _stores(self, key: str) -> builtins.list[ByteStore]:
        st = self._of(key)
        return self.stores if st is None else [st]

    def describe(self, key: str) -> str:
        st = self._of(key)
        if st is not None:
            return st.describe(key)
        if not key:
            return " + ".join(dict.fromkeys(st.describe("") for st in self.stores))
        return self.stores[0].describe(key)

    async def read(self, key: str, start: int | None = None, stop: int | None = None) -> Any:
        *first, last = self._stores(key)
        for st in first:
            try:
                return await st.read(key, start, stop)
            except MissingShardError:
                continue
        return await last.read(key, start, stop)

    async def read_ranges(self, key: str, ranges: Any, *, return_exceptions: bool = False) -> builtins.list:
        st = self._of(key) or self.stores[0]
        return await st.read_ranges(key, ranges, return_exceptions=return_exceptions)

    async def exists(self, key: str) -> bool:
        for st in self._stores(key):
            if await st.exists(key):
                return True
        return False

    async def list(self, prefix: str = "") -> builtins.list[str]:
        names: set[str] = set()
        for st in self._stores(prefix):
            names.update(await st.list(prefix))
        return sorted(names)

    async def stat(self, key: str) -> Stat:
        return await (self._of(key) or self.stores[0]).stat(key)

    async def size(self, key: str) -> int:
        return await (self._of(key) or self.stores[0]).size(key)

    async def is_folder(self, prefix: str) -> bool:
        for st in self._stores(prefix):
            if await st.is_folder(prefix):
                return True
        return False

    async def sample(self, prefix: str, n: int) -> builtins.list[str] | None:
        st = self._of(prefix)
        return await st.sample(prefix, n) if st is not None else None

    def map(self, key: str) -> Any:
        return (self._of(key) or self.stores[0]).map(key)


def parse_manifest(data: bytes, where: str) -> dict:
    """A job's manifest: a JSON object with ``job`` and ``complete`` (else SpecError naming ``where``)."""
    m = parse_json(bytes(data), f"{where} (a dvidshards manifest)")
    if "complete" not in m or not isinstance(m.get("job"), str):
        raise SpecError(f"{where}: not a dvidshards manifest (no 'job' and 'complete' members)")
    return m


def downsample_manifest(store: ByteStore) -> dict | None:
    """A downsample job's manifest at the root of store (None: no manifest, or another job's)."""
    try:
        data = store.read_sync(MANIFEST)
    except (MissingShardError, RemoteReadError):  # a store that fails says so at the first file a read needs
        return None
    where = store.describe(MANIFEST)
    m = parse_manifest(bytes(data), where)
    if m.get("job") != "downsample":
        return None
    src = m.get("source")
    url = src.get("url") if isinstance(src, dict) else None
    scales = m.get("scales")
    ident = src.get("identity") if isinstance(src, dict) else None
    if not isinstance(url, str) or not url or not isinstance(scales, list) or \
            not all(type(k) is int and k >= 0 for k in scales) or not isinstance(m.get("complete"), bool) or \
            not (ident is None or isinstance(ident, dict) and isinstance(ident.get("sample"), dict)):
        raise SpecError(f"{where}: a downsample manifest needs source.url (the export it was made from), "
                        f"scales (a list of scale numbers) and complete (true or false)")
    return m


def _beside(store: ByteStore, rel: str) -> str | dict | None:
    """The location at relative path ``rel`` from store's root (None: store has no path)."""
    path = store.local_path()
    if path is not None:
        return os.path.normpath(os.path.join(path, rel))
    spec = store.kvstore_spec()
    if spec is None:
        return None
    where = posixpath.normpath(posixpath.join("/" + spec.get("path", "").strip("/"), rel)).strip("/")
    return {**spec, "path": where + "/" if where else ""}


def _sizes(store: ByteStore, keys: builtins.list[str]) -> dict[str, int | None]:
    """The sizes of files (None: absent), asked concurrently."""

    async def one(key: str) -> int | None:
        try:
            return await store.size(key)
        except MissingShardError:
            return None

    return dict(zip(keys, drive_all(store, (one(k) for k in keys)), strict=True))


def _spread(items: builtins.list, n: int) -> builtins.list:
    """Up to n items spread evenly over a sorted list, its first and last included."""
    if len(items) <= n:
        return items
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


def shard_sizes(store: ByteStore, scale: Scale, origins: Iterable) -> dict[str, int | None]:
    """The size of every shard file of a scale at the given origins (asked concurrently)."""
    return _sizes(store, sorted(scale.stem(o) + ".arrow" for o in origins))


def source_identity(scale: int, sizes: dict[str, int | None]) -> dict:
    """What a downsample output records of the scale it was made from: ``sha256`` of every shard
    file's size, ``sample`` a few of them (an open stats those; ``verify`` all).

    A compressed shard's size fingerprints its content: another export, or a snapshot whose
    supervoxels differ, changes it; a copy or an upload keeps it (mtimes and generations survive
    neither). Blind spot: a snapshot that differs only by merges (other bodies, same supervoxels).
    """
    keys = sorted(sizes)
    return {"scale": int(scale), "shards": len(keys), "sha256": _digest(sizes),
            "sample": {k: sizes[k] for k in _spread(keys, _SAMPLE)}}


def _digest(sizes: dict[str, int | None]) -> str:
    return hashlib.sha256("".join(f"{k} {v}\n" for k, v in sorted(sizes.items())).encode()).hexdigest()


def identity_changes(store: ByteStore, identity: dict, now: dict | None = None) -> str | None:
    """How the files a downsample output was made from differ from ``store``'s now (None: they do
    not). ``now``: the sample's sizes (default: asked), or a ``source_identity`` of every file."""
    sample: dict = identity["sample"]
    every = now if now is not None and "sha256" in now else None
    sizes = now if every is None else every["sample"]
    if sizes is None or sizes.keys() != sample.keys():
        sizes = _sizes(store, builtins.list(sample))
    bad = [k for k in sample if sizes[k] != sample[k]]
    if bad:
        k = bad[0]
        was = f"{sample[k]:,} bytes when the scales were made" if sample[k] is not None else "absent then"
        got = f"is {sizes[k]:,} bytes" if sizes.get(k) is not None else "is missing"
        more = f" ({len(bad)} of the {len(sample)} files compared differ)" if len(bad) > 1 else ""
        return f"{store.describe(k)} {got}, {was}{more}"
    if every is not None and (every["shards"], every["sha256"]) != (identity["shards"], identity["sha256"]):
        return (f"the sizes of its {every['shards']:,} shard files at s{identity['scale']} differ from those of "
                f"the {identity['shards']:,} the scales were made from")
    return None


def _stat_order(layers: builtins.list[Layer], k: int) -> builtins.list[ByteStore]:
    """The roots to look for scale k's files in, in ``Dataset``'s routing order."""
    made = [st for st, held, m in reversed(layers) if m is not None and held is not None and k in held]
    return made + [st for st, _, _ in layers if st not in made]


def check_source(store: ByteStore, m: dict, layers: builtins.list[Layer]) -> str | None:
    """None when ``layers`` hold the files the downsample output at ``store`` was made from (or its
    manifest records none); ``ABSENT`` when they hold none of them; else what differs."""
    ident = m["source"].get("identity")
    if ident is None or not layers:
        return None
    keys = builtins.list(ident["sample"])
    for st in _stat_order(layers, int(ident["scale"])):  # the first root holding the sample's files
        now = _sizes(st, keys)
        if any(v is not None for v in now.values()):
            return identity_changes(st, ident, now)
    return ABSENT


def mixed_error(store: ByteStore, m: dict, source: str, why: str) -> SpecError:
    """The error of a downsample output whose source changed since its scales were made."""
    made = scales_phrase(m["scales"])
    return SpecError(f"{store.describe('')}: its {made} were made from {source} as it was then, and it has changed "
                     f"since ({why}): read together they would mix two exports. Make them again (dvidshards "
                     f"downsample {source} {store.describe('')} --overwrite), or open {source} alone")


def roots_of(store: ByteStore, depth: int = 0) -> builtins.list[Layer]:
    """The layers of a root: itself and, for a downsample output, its source's below it (found
    where the relative path leads, else at its URL, and checked). A LayeredStore as it is routed."""
    if isinstance(store, LayeredStore):
        return [(st, frozenset(k for k, j in store.route.items() if j == i), None)
                for i, st in enumerate(store.stores)]
    m = downsample_manifest(store)
    if m is None:
        return [(store, None, None)]
    if depth > 8:
        raise SpecError(f"{store.describe(MANIFEST)}: downsample manifests name each other's outputs in a loop")
    src = m["source"]
    places: builtins.list = []
    if isinstance(src.get("relative"), str):
        places.append(_beside(store, src["relative"]))
    places.append(src["url"])
    tried: builtins.list[Any] = []
    changed = None
    for place in places:
        if place is None:
            continue
        try:
            source = as_store(place)
        except SpecError as e:
            tried.append(str(e))
            continue
        if any(source == st for st in tried):
            continue
        tried.append(source)
        below = roots_of(source, depth + 1)
        why = check_source(store, m, below)
        if why is None:
            return [*below, (store, frozenset(m["scales"]), m)]
        if why == ABSENT:
            tried[-1] = f"{source.describe('')}: none of the files it was made from is there"
        else:
            changed = changed or mixed_error(store, m, source.describe("").rstrip("/"), why)
    if changed is not None:
        raise changed
    said = "; ".join(t if isinstance(t, str) else t.describe("") for t in tried)
    raise SpecError(f"{store.describe(MANIFEST)}: the export this was downsampled from cannot be opened ({said}); "
                    f"give it with it: dvidshards.open([EXPORT, {store.describe('')!r}])")


def given_roots(stores: builtins.list[ByteStore]) -> builtins.list[Layer]:
    """The layers of roots given together (``Dataset([export, output])``): a downsample output's
    source is checked among them, not followed; found as for one root when none holds its files."""
    given: builtins.list[Layer] = []
    for st in stores:
        m = None if isinstance(st, LayeredStore) else downsample_manifest(st)
        given += roots_of(st) if m is None else [(st, frozenset(m["scales"]), m)]
    layers: builtins.list[Layer] = []
    for st, held, m in given:
        if m is not None:
            others = [layer for layer in given if layer[0] != st]
            why = check_source(st, m, others)
            if why == ABSENT:
                layers += [x for x in roots_of(st)[:-1] if not any(x[0] == y for y, _, _ in layers)]
            elif why is not None:
                raise mixed_error(st, m, " + ".join(o[0].describe("").rstrip("/") for o in others), why)
        if not any(st == x for x, _, _ in layers):
            layers.append((st, held, m))
    return layers


async def present_scales(store: ByteStore, indices: builtins.list[int], known: dict[int, bool]) -> set[int]:
    """The scales among ``indices`` whose folder the root holds (``known``: what listings said).

    A local folder is listed once. Elsewhere a root listing lists every file of the export, so
    scale folders are listed coarsest first, a few at once, until one is found: an export holds a
    prefix of its scales (FORMATS.md §3a). Scale 0 is taken as present.
    """
    if store.immediate:
        names = set(await store.list(""))
        return {k for k in indices if f"s{k}" in names}
    todo = sorted(indices, reverse=True)
    while todo:
        k = todo[0]
        if k in known:
            todo.pop(0)
            if known[k]:
                return {j for j in indices if j <= k}
            continue
        group = [j for j in todo[:_PRESENCE_GROUP] if j not in known and j > 0]
        if not group:
            break
        found = await asyncio.gather(*(store.list(f"s{j}") for j in group))
        known.update({j: bool(f) for j, f in zip(group, found, strict=True)})
    return {j for j in indices if j == 0}


def drive_all(store: ByteStore, coros: Iterable[Any]) -> builtins.list:
    """Run coroutines on a store: one after the other when it never waits, else together."""
    coros = builtins.list(coros)
    if store.immediate:
        return [store._sync(c) for c in coros]

    async def together() -> builtins.list:
        return await asyncio.gather(*coros)

    return store._sync(together())

