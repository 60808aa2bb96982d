"""The shipped .proto files and their generated modules (dvidshards/formats/proto/): the modules
hold exactly the messages and fields the .proto files declare (nothing is regenerated here), and
the messages written with them are the wire bytes PCG and DVID read."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("google.protobuf")

from dvidshards.formats import labelindex, pcg

PROTO = Path(labelindex.__file__).parent / "proto"
FILES = sorted(PROTO.glob("*.proto"))
_SCALAR = {"bytes": 12, "string": 9, "uint64": 4, "uint32": 13, "fixed64": 6, "float": 2, "bool": 8}


def _declared(text: str) -> tuple[str, dict[str, dict[str, tuple]]]:
    """(package, {message: {field: (number, type, repeated)}}) of a .proto file's text."""
    text = re.sub(r"//[^\n]*", "", text)
    package = re.search(r"package\s+([\w.]+)\s*;", text).group(1)
    out: dict[str, dict[str, tuple]] = {}
    for name, body in re.findall(r"message\s+(\w+)\s*\{([^}]*)\}", text):
        fields = {}
        for rep, typ, fname, num in re.findall(r"(?m)^\s*(repeated\s+)?(\w+|map<[^>]*>)\s+(\w+)\s*=\s*(\d+)\s*;", body):
            fields[fname] = (int(num), typ.replace(" ", ""), bool(rep))
        out[name] = fields
    return package, out


def _repeated(f) -> bool:
    return f.is_repeated if hasattr(f, "is_repeated") else f.label == f.LABEL_REPEATED  # (protobuf < 6.31)


def _generated(path: Path):
    return importlib.import_module(f"dvidshards.formats.proto.{path.stem}_pb2")


def test_there_are_proto_files_with_modules():
    assert {p.stem for p in FILES} == {"labelops", "chunkEdges", "chunkComponents"}
    assert all((p.parent / f"{p.stem}_pb2.py").is_file() for p in FILES)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_the_generated_module_holds_what_the_proto_declares(path):
    package, messages = _declared(path.read_text())
    d = _generated(path).DESCRIPTOR
    assert d.package == package and d.name == f"dvidshards/formats/proto/{path.name}"
    assert set(d.message_types_by_name) == set(messages)
    for mname, fields in messages.items():
        m = d.message_types_by_name[mname]
        assert set(m.fields_by_name) == set(fields), mname
        for fname, (num, typ, repeated) in fields.items():
            f = m.fields_by_name[fname]
            assert f.number == num, (mname, fname)
            if typ.startswith("map<"):
                assert _repeated(f)
                key, value = typ[4:-1].split(",")
                entry = f.message_type
                assert entry.GetOptions().map_entry
                assert entry.fields_by_name["key"].type == _SCALAR[key]
                v = entry.fields_by_name["value"]
                assert (v.message_type.name if v.message_type else v.type) == _SCALAR.get(value, value)
                continue
            assert _repeated(f) == repeated, (mname, fname)
            if typ in _SCALAR:
                assert f.type == _SCALAR[typ] and f.message_type is None, (mname, fname)
            else:
                assert f.message_type.name == typ, (mname, fname)


# --- wire bytes, against a writer of protobuf's wire format written here ------------------------------


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def _field(num: int, payload: bytes) -> bytes:
    return _varint(num << 3 | 2) + _varint(len(payload)) + payload


def test_pcg_edges_and_components_are_pcgs_wire_bytes():
    rng = np.random.default_rng(3)
    edges = {}
    for name in ("in", "between", "cross"):
        n = int(rng.integers(0, 50))
        edges[name] = (rng.integers(1, 2**63, n, dtype=np.uint64), rng.integers(1, 2**63, n, dtype=np.uint64),
                       rng.random(n, dtype=np.float32), rng.integers(1, 1000, n, dtype=np.uint64))
    want = b""
    for num, name in ((1, "in"), (2, "cross"), (3, "between")):  # field order: in_chunk, cross_chunk, between
        cols = edges[name]
        sub = b"".join(_field(k, np.ascontiguousarray(c, t).tobytes()) for k, (c, t)
                       in enumerate(zip(cols, ("<u8", "<u8", "<f4", "<u8"), strict=True), 1) if len(c))
        want += _field(num, sub)
    assert pcg.encode_edges(edges) == want
    groups = [np.array([5, 2**64 - 1], np.uint64), np.array([7], np.uint64)]
    flat = [2, 5, 2**64 - 1, 1, 7]
    assert pcg.encode_components(groups) == _field(1, b"".join(_varint(v) for v in flat))


def test_label_index_bytes_read_by_the_generated_class_as_dvid_clients_do():
    """The hand-written encoder's bytes, parsed by protobuf (as neuclease's fetch_labelindex does)."""
    from dvidshards.formats.proto import labelops_pb2

    rng = np.random.default_rng(4)
    for _ in range(20):
        n = int(rng.integers(0, 400))
        blocks = rng.integers(-5, 5, (n, 3))
        sv = rng.integers(0, 2**64 - 1, n, dtype=np.uint64) if n % 2 else rng.integers(0, 6, n).astype(np.uint64)
        vox = rng.integers(0, 1000, n)
        want: dict = {}
        for c, s, v in zip(blocks.tolist(), sv.tolist(), vox.tolist(), strict=True):
            counts = want.setdefault(tuple(c), {})
            counts[s] = counts.get(s, 0) + v
        data = labelindex.encode_label_index(n, blocks, sv, vox, last_mut_id=3, last_mod_app="dvidshards")
        msg = labelops_pb2.LabelIndex()
        msg.ParseFromString(data)
        assert (msg.label, msg.last_mutid, msg.last_mod_app) == (n, 3, "dvidshards")
        keys = list(msg.blocks)
        got = {tuple(c): dict(msg.blocks[k].counts)
               for c, k in zip(labelindex.decode_block_index(np.array(keys, np.uint64)).tolist(), keys, strict=True)}
        assert got == want
        assert labelindex.decode_label_index(data)["blocks"] == want
