"""PCG edges and components decoded independently (protobuf classes built from the .proto text), and
the brute-force edges of a volume."""

from __future__ import annotations

from collections import Counter

import numpy as np

# PyChunkedGraph's chunkEdges.proto and chunkComponents.proto, written out by hand in
# FileDescriptorProto text form (not built by dvidshards' code)
EDGES_PROTO = """
name: "test/chunkEdges.proto" package: "edges" syntax: "proto3"
message_type {
  name: "EdgesMsg"
  field { name: "node_ids1" number: 1 label: LABEL_OPTIONAL type: TYPE_BYTES }
  field { name: "node_ids2" number: 2 label: LABEL_OPTIONAL type: TYPE_BYTES }
  field { name: "affinities" number: 3 label: LABEL_OPTIONAL type: TYPE_BYTES }
  field { name: "areas" number: 4 label: LABEL_OPTIONAL type: TYPE_BYTES }
}
message_type {
  name: "ChunkEdgesMsg"
  field { name: "in_chunk" number: 1 label: LABEL_OPTIONAL type: TYPE_MESSAGE type_name: ".edges.EdgesMsg" }
  field { name: "cross_chunk" number: 2 label: LABEL_OPTIONAL type: TYPE_MESSAGE type_name: ".edges.EdgesMsg" }
  field { name: "between_chunk" number: 3 label: LABEL_OPTIONAL type: TYPE_MESSAGE type_name: ".edges.EdgesMsg" }
}
"""


COMPONENTS_PROTO = """
name: "test/chunkComponents.proto" package: "components" syntax: "proto3"
message_type {
  name: "ChunkComponentsMsg"
  field { name: "components" number: 1 label: LABEL_REPEATED type: TYPE_UINT64 }
}
"""


def independent_classes():
    """(ChunkEdgesMsg, ChunkComponentsMsg) from the hand-written descriptors above."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format

    pool = descriptor_pool.DescriptorPool()
    for text in (EDGES_PROTO, COMPONENTS_PROTO):
        pool.Add(text_format.Parse(text, descriptor_pb2.FileDescriptorProto()))
    get = message_factory.GetMessageClass
    return (get(pool.FindMessageTypeByName("edges.ChunkEdgesMsg")),
            get(pool.FindMessageTypeByName("components.ChunkComponentsMsg")))


def decode_independently(raw: bytes) -> dict:
    """A decompressed edges payload decoded with the independent class (raw LE arrays)."""
    cls, _ = independent_classes()
    m = cls()
    m.ParseFromString(raw)
    out = {}
    for name, field in (("in", "in_chunk"), ("between", "between_chunk"), ("cross", "cross_chunk")):
        sub = getattr(m, field)
        out[name] = (np.frombuffer(sub.node_ids1, "<u8"), np.frombuffer(sub.node_ids2, "<u8"),
                     np.frombuffer(sub.affinities, "<f4"), np.frombuffer(sub.areas, "<u8"))
    return out


def components_independently(raw: bytes) -> list[list[int]]:
    _, cls = independent_classes()
    m = cls()
    m.ParseFromString(raw)
    flat, out, i = list(m.components), [], 0
    while i < len(flat):
        out.append(flat[i + 1:i + 1 + flat[i]])
        i += 1 + flat[i]
    return out


def brute_force(vol_xyz, cs, origin=(0, 0, 0)):
    """{((sv, chunk), (sv, chunk)): faces} over 6-connected contacts of different pieces (sorted pairs),
    and {(sv, chunk): voxels}; voxel [0, 0, 0] of vol_xyz is at ``origin`` of the chunk grid."""
    assert vol_xyz.max(initial=0) < 1 << 63
    vol = vol_xyz.astype(np.int64)
    ch = [(o + np.arange(n)) // c for o, n, c in zip(origin, vol.shape, cs, strict=True)]
    rows = [np.zeros((0, 8), np.int64)]
    for ax in range(3):
        n = vol.shape[ax]
        a = np.take(vol, range(n - 1), axis=ax)
        b = np.take(vol, range(1, n), axis=ax)
        ca = [np.take(c, range(n - 1)) if k == ax else c for k, c in enumerate(ch)]
        cb = [np.take(c, range(1, n)) if k == ax else c for k, c in enumerate(ch)]
        cross_chunk = (ca[ax] != cb[ax]).reshape([-1 if k == ax else 1 for k in range(3)])
        m = (a != 0) & (b != 0) & ((a != b) | cross_chunk)
        idx = np.nonzero(m)
        rows.append(np.stack([a[idx], *(ca[k][idx[k]] for k in range(3)), b[idx], *(cb[k][idx[k]] for k in range(3))],
                             1))
    r = np.concatenate(rows)
    pairs = Counter(dict(zip(*_count_rows(r), strict=True)))
    canon = Counter()
    for k, c in pairs.items():
        p, q = (k[0], k[1:4]), (k[4], k[5:8])
        canon[(p, q) if p < q else (q, p)] += c
    pairs = canon
    nz = np.nonzero(vol)
    vox = {(k[0], k[1:]): c for k, c in zip(*_count_rows(np.stack([vol[nz], *(c[i] for c, i in zip(ch, nz, strict=True))],
                                                                        1)), strict=True)}
    return pairs, vox


def _count_rows(rows: np.ndarray):
    """Distinct rows (sv, cx, cy, cz)* of an int64 array as tuples, and how often each occurs."""
    if not len(rows):
        return [], []
    cols = []
    for k in range(rows.shape[1]):  # each column to a dense code, then one int64 key per row
        u, inv = np.unique(rows[:, k], return_inverse=True)
        cols.append((u, inv.ravel()))
    key = np.zeros(len(rows), np.int64)
    for u, inv in cols:
        assert (int(key.max()) + 1) * len(u) < 1 << 62
        key = key * len(u) + inv
    uk, first, cnt = np.unique(key, return_index=True, return_counts=True)
    return [tuple(t) for t in rows[first].tolist()], cnt.tolist()
