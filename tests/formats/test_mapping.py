"""Label mappings: every accepted form, DVID's /mappings files, and every bad input a user met."""

from __future__ import annotations

import gzip
import pickle

import numpy as np
import pytest

import dvidshards
from dvidshards import Dataset
from dvidshards.errors import MappingError
from dvidshards.formats import mapping as fm
from dvidshards.formats.mapping import LabelMapping
from dvidshards.runtime import mappings as rt

SV = np.array([5, 1 << 40, 7, 0, 9], np.uint64)


def _check(m):
    np.testing.assert_array_equal(m.palette(SV), [50, 11, 7, 0, 9])  # unmapped ids keep their id


def _pairs(m) -> dict[int, int]:
    return dict(zip(m.keys.tolist(), m.values.tolist(), strict=True))


def test_forms():
    _check(LabelMapping.from_any({5: 50, 1 << 40: 11}))
    _check(LabelMapping.from_any(np.array([[5, 50], [1 << 40, 11]], np.uint64)))
    _check(LabelMapping.from_any([[5, 50], [1 << 40, 11], [5, 50]]))  # a repeated identical pair is fine
    _check(LabelMapping.from_any(np.array([[5.0, 50.0], [float(1 << 40), 11.0]])))  # integral floats
    pd = pytest.importorskip("pandas")
    _check(LabelMapping.from_any(pd.Series([50, 11], index=pd.Index([5, 1 << 40], dtype="uint64"), dtype="uint64")))
    _check(LabelMapping.from_any(pd.Series([50, 11], index=[5, 1 << 40])))


def test_maps_arrays_of_any_shape_and_pickles():
    m = LabelMapping.from_any({5: 50, (1 << 64) - 1: 3})
    np.testing.assert_array_equal(m(np.array([[5, 6], [0, (1 << 64) - 1]], np.uint64)), [[50, 6], [0, 3]])
    again = pickle.loads(pickle.dumps(m))
    assert _pairs(again) == _pairs(m) == {5: 50, (1 << 64) - 1: 3}


def test_sorting_large_unsorted_input_is_exact():
    rng = np.random.default_rng(4)
    sv = rng.permutation(np.arange(200_000, dtype=np.uint64) * np.uint64(0x10001) + np.uint64(1 << 50))
    body = sv // np.uint64(3) + np.uint64(1)
    sv_in, body_in = sv.copy(), body.copy()
    m = LabelMapping(sv, body)
    order = np.argsort(sv_in)
    np.testing.assert_array_equal(m.keys, sv_in[order])
    np.testing.assert_array_equal(m.values, body_in[order])
    np.testing.assert_array_equal(sv, sv_in)  # the caller's arrays are left alone
    probe = np.concatenate([sv_in[:1000], np.array([3, 4], np.uint64)])
    np.testing.assert_array_equal(m(probe), np.concatenate([body_in[:1000], [3, 4]]))


@pytest.mark.parametrize("obj,match", [
    (np.array([[5, 50], [5, 51]]), "supervoxel 5 is mapped to both 50 and 51"),
    (np.array([[-1, 5]]), r"row 0 column 0 \(supervoxel\) is -1, which is negative"),
    (np.array([[1, 5], [2, -7]]), r"row 1 column 1 \(body\) is -7, which is negative"),
    (np.array([[1.7, 5.0]]), r"row 0 column 0 \(supervoxel\) is 1.7, which is not an integer"),
    (np.array([[2.0, np.nan]]), r"row 0 column 1 \(body\) is nan, which is NaN"),
    (np.array([[float(1 << 60), 1.0]]), "too large to hold an id exactly"),
    (np.array([1, 2, 3]), r"\(n, 2\) array"),
    (np.array([["1", "2"]]), "text"),
    (object(), "must be"),
])
def test_bad_arrays(obj, match):
    with pytest.raises(MappingError, match=match):
        LabelMapping.from_any(obj)


@pytest.mark.parametrize("obj,match", [
    ({1.7: 5}, "mapping dict: a key is 1.7, which is not an integer"),
    ({"5": 50}, "mapping dict: a key is '5', which is text"),
    ({-5: 50}, "a key is -5, which is negative"),
    ({True: 5}, "boolean"),
    ({5: float("nan")}, "the value of key 5 is nan, which is NaN"),
    ({5: None}, "the value of key 5 is None, which is NaN"),
    ({5: 1 << 64}, "larger than 2"),
])
def test_bad_dicts(obj, match):
    with pytest.raises(MappingError, match=match):
        LabelMapping.from_any(obj)


def test_bad_series():
    pd = pytest.importorskip("pandas")
    s = pd.Series([10.0, np.nan, 30.0], index=[1, 2, 3])  # a NaN turns the values into floats
    with pytest.raises(MappingError, match=r"the value at index 2 is nan, which is NaN"):
        LabelMapping.from_any(s)
    s = pd.Series([10, 20], index=[1.0, 1.7])
    with pytest.raises(MappingError, match=r"the index at position 1 is 1.7, which is not an integer"):
        LabelMapping.from_any(s)
    s = pd.Series([10, 20], index=[1.0, np.nan])
    with pytest.raises(MappingError, match=r"the index at position 1 is nan"):
        LabelMapping.from_any(s)
    s = pd.Series([10, pd.NA], index=[1, 2], dtype="Int64")
    with pytest.raises(MappingError, match=r"the value at index 2 is (nan|<NA>), which is NaN"):
        LabelMapping.from_any(s)
    s = pd.Series([10, -20], index=[1, 2])
    with pytest.raises(MappingError, match=r"the value at index 2 is -20, which is negative"):
        LabelMapping.from_any(s)


# --------------------------------------------------------------------------- files


def _load(tmp_path, content: bytes, name="m.txt", **kw):
    p = tmp_path / name
    p.write_bytes(content)
    return LabelMapping.from_file(p, **kw)


@pytest.mark.parametrize("content", [
    b"5 50\n1099511627776 11\n",                      # DVID's text output
    b"5 50\n1099511627776 11",                        # no final newline
    b"sv_id,body_id\n5,50\n1099511627776,11\n",       # header and commas
    b"sv body\r\n5 50\r\n1099511627776 11\r\n",       # header, CRLF
    b"5\t50\n1099511627776\t11\n",                    # tabs
    b"5, 50\n1099511627776 ,11\n",                    # blanks around commas
    b"# exported from DVID\n\n5 50\n\n1099511627776 11\n\n",  # comments and blank lines
    b"# a comment\nsv body # names\n  5   50  # trailing\n1099511627776\t 11\t\n",  # all at once
    b"\xef\xbb\xbfsv,body\n5,50\n1099511627776,11\n",  # a UTF-8 byte order mark
    b"5 50\n1099511627776 11\n3 3\n33 4\n\n",        # 32 bytes: once read as binary by length
])
def test_text_files(tmp_path, content):
    m = _load(tmp_path, content)
    _check(m)
    assert set(_pairs(m)) <= {5, 1 << 40, 3, 33}


def test_text_file_whose_length_is_a_multiple_of_16(tmp_path):
    content = b"1 10\n2 20\n33 4\n\n"
    assert len(content) % 16 == 0
    assert _pairs(_load(tmp_path, content)) == {1: 10, 2: 20, 33: 4}


def test_binary_files(tmp_path):
    pairs = np.array([[5, 50], [1 << 40, 11]], "<u8")
    _check(_load(tmp_path, pairs.tobytes(), "m.bin"))  # NUL bytes: cannot be text
    _check(_load(tmp_path, pairs.tobytes(), "m.bin", format="binary"))
    # printable bytes are binary only when asked for
    text_like = np.frombuffer(b"12345678" * 2, "<u8").reshape(1, 2)
    m = _load(tmp_path, text_like.tobytes(), "odd.bin", format="binary")
    assert _pairs(m) == {int(text_like[0, 0]): int(text_like[0, 1])}
    with pytest.raises(MappingError, match="line 1"):
        _load(tmp_path, text_like.tobytes(), "odd.bin")


def test_empty_files(tmp_path):
    """A file of 0 bytes is an error (an interrupted download), not an empty mapping; a header
    alone, or only comments, is a mapping of nothing."""
    with pytest.raises(MappingError, match=r"m.txt: the mapping file is empty \(0 bytes\)"):
        _load(tmp_path, b"")
    assert len(_load(tmp_path, b"sv body\n")) == 0
    assert len(_load(tmp_path, b"# nothing\n\n")) == 0


@pytest.mark.parametrize("content,match", [
    (b"1 10\n2 20\n-3 30\n", r"line 3: supervoxel id '-3' is negative"),
    (b"sv_id,body_id\n1,10\n1.7,20\n", r"line 3: supervoxel id '1.7' is not an integer"),
    (b"1 10\n2 NaN\n", r"line 2: body id 'NaN' is NaN"),
    (b"1,10\n2,nan\n", r"line 2: body id 'nan' is NaN"),
    (b"1 10\n2 sixty\n", r"line 2: body id 'sixty' is not a number"),
    (b"1 10\n2 1e3\n", r"line 2: body id '1e3' is written as a float"),
    (b"1 10\n2 18446744073709551616\n", r"line 2: body id '18446744073709551616' is larger than 2\*\*64 - 1"),
    (b"1 10\n2 +20\n", r"line 2: body id '\+20' is not a plain decimal integer"),
    (b"1 10\n\n# c\n7\n", r"line 4 is '7': expected two ids .* found 1 field"),
    (b"1 10 5\n", r"line 1 is '1 10 5': expected two ids .* found 3 field"),
    (b"1,10\n2 20\n", r"line 2 is '2 20': expected two ids .* separated by a comma"),
    (b"1 10\n2 20\n# ok\n-3 30 # bad\n", r"line 4: supervoxel id '-3' is negative"),
    (b'"1","10"\n', r"line 1: supervoxel id '\"1\"' is not a number"),
])
def test_bad_text_files(tmp_path, content, match):
    with pytest.raises(MappingError, match=match) as e:
        _load(tmp_path, content, "bad.txt")
    assert str(tmp_path / "bad.txt") in str(e.value)


def test_bad_line_far_into_a_file(tmp_path):
    content = b"sv body\n" + b"".join(b"%d %d\n" % (i, i * 10) for i in range(1, 50_001)) + b"7 -70\n1 1\n"
    with pytest.raises(MappingError, match=r"line 50002: body id '-70' is negative"):
        _load(tmp_path, content)


def test_nul_after_the_first_64_kib_names_the_line(tmp_path):
    content = b"1 10\n" * 20_000 + b"2 2\x000\n"
    with pytest.raises(MappingError, match=r"line 20001: .*pass format='binary'"):
        _load(tmp_path, content)


def test_bad_binary_and_unreadable_files(tmp_path):
    with pytest.raises(MappingError, match="whole number of 16-byte pairs"):
        _load(tmp_path, b"\x00\xff" * 9, "odd.bin")
    with pytest.raises(MappingError, match="cannot read"):
        LabelMapping.from_file(tmp_path / "absent.txt")
    with pytest.raises(MappingError, match="cannot read"):
        LabelMapping.from_file(tmp_path)
    with pytest.raises(MappingError, match="format must be"):
        _load(tmp_path, b"1 2\n", format="csv")


def test_large_text_file_matches_numpy(tmp_path):
    rng = np.random.default_rng(9)
    sv = rng.choice(1 << 45, 300_000, replace=False).astype(np.uint64)
    body = rng.integers(1, 1 << 40, sv.size, dtype=np.uint64)
    p = tmp_path / "big.txt"
    np.savetxt(p, np.stack([sv, body], 1), fmt="%d", delimiter=" ")
    m = LabelMapping.from_file(p)
    order = np.argsort(sv)
    np.testing.assert_array_equal(m.keys, sv[order])
    np.testing.assert_array_equal(m.values, body[order])


# --------------------------------------------------------------------------- 0 is background


@pytest.mark.parametrize("content,name,match", [
    (b"1 10\n0 42\n", "m.txt", r"m.txt: line 2 maps supervoxel 0 to body 42"),
    (b"# DVID\nsv body\n\n1 10\n\n# more\n0 42\n", "m.txt", r"m.txt: line 7 maps supervoxel 0 to body 42"),
    (b"sv_id,body_id\n1,10\n00,7\n", "m.csv", r"m.csv: line 3 maps supervoxel 0 to body 7"),
    (np.array([[1, 10], [0, 42]], "<u8").tobytes(), "m.bin", r"m.bin: pair #1 \(byte offset 16\) maps supervoxel 0"),
])
def test_mapping_file_sending_0_to_a_body_is_refused(tmp_path, content, name, match):
    with pytest.raises(MappingError, match=match) as e:
        _load(tmp_path, content, name)
    assert str(tmp_path / name) in str(e.value) and "background" in str(e.value)


def test_mapping_objects_sending_0_to_a_body_are_refused():
    pd = pytest.importorskip("pandas")
    for obj, match in [({1: 10, 0: 42}, "mapping dict: key 0 maps supervoxel 0 to body 42"),
                       (np.array([[1, 10], [0, 42]]), "mapping array: row 1 maps supervoxel 0 to body 42"),
                       (pd.Series([10, 42], index=[1, 0]), "mapping Series: the index at position 1 maps")]:
        with pytest.raises(MappingError, match=match):
            LabelMapping.from_any(obj)
    with pytest.raises(MappingError, match="row #0 maps supervoxel 0 to body 3"):
        LabelMapping(np.array([0], np.uint64), np.array([3], np.uint64))


def test_zero_to_zero_is_fine(tmp_path):
    m = _load(tmp_path, b"0 0\n5 50\n")
    np.testing.assert_array_equal(m.palette(SV), [50, 1 << 40, 7, 0, 9])
    assert _pairs(LabelMapping.from_any({0: 0, 5: 50})) == {0: 0, 5: 50}


# --------------------------------------------------------------------------- once per process


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private mapping cache folder, with sidecars for files of any size; memory cleared."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("DVIDSHARDS_CACHE_DIR", str(folder))
    monkeypatch.setenv("DVIDSHARDS_MAPPING_SIDECAR_BYTES", "0")
    rt.clear_cache()
    yield folder / "mappings"
    rt.clear_cache()


def _mapping_file(tmp_path, n=5000, seed=0, name="map.txt"):
    rng = np.random.default_rng(seed)
    sv = rng.choice(1 << 40, n, replace=False).astype(np.uint64) + np.uint64(1)
    body = sv // np.uint64(7) + np.uint64(1)
    p = tmp_path / name
    p.write_text("sv body\n" + "".join(f"{a} {b}\n" for a, b in zip(sv.tolist(), body.tolist(), strict=True)))
    return p, sv, body


def test_a_mapping_file_is_parsed_once_and_shared_through_its_sidecar(tmp_path, cache):
    p, sv, body = _mapping_file(tmp_path)
    a = fm.load_file(p)
    b = LabelMapping.from_any(str(p))  # what readers and jobs call: the same object
    info = rt.cache_info()  # parsed once, by a child process that wrote the sidecar this process maps
    assert a is b and (info["parsed"], info["built"], info["opened"], info["hits"]) == (0, 1, 1, 1)
    np.testing.assert_array_equal(a(sv), body)
    sidecars = [d for d in cache.iterdir() if d.is_dir()]
    assert len(sidecars) == 1 and {f.name for f in sidecars[0].iterdir()} == {"keys.npy", "values.npy", "meta.json"}
    rt.clear_cache()  # as a new process of the same host: memory-maps the sidecar, parses nothing
    c = fm.load_file(p)
    assert (rt.cache_info()["built"], rt.cache_info()["opened"]) == (0, 1)
    assert not c.keys.flags.writeable and isinstance(c.keys.base, np.memmap)
    np.testing.assert_array_equal(c(sv), body)
    assert pickle.loads(pickle.dumps(c)).palette(sv[:5]).tolist() == body[:5].tolist()  # by value


def test_a_changed_file_gets_a_new_sidecar_and_the_old_one_goes(tmp_path, cache):
    p, sv, body = _mapping_file(tmp_path)
    planned = fm.file_stamp(p)
    fm.load_file(p)
    p.write_text(f"{sv[0]} 99\n")
    with pytest.raises(MappingError, match="changed after the job was planned"):
        fm.load_file(p, planned)
    assert fm.load_file(p)(sv[:2]).tolist() == [99, sv[1]]
    assert len([d for d in cache.iterdir() if d.is_dir()]) == 1  # the old version's sidecar is deleted


def test_a_bad_file_fails_every_process_without_parsing_again(tmp_path, cache):
    p = tmp_path / "bad.txt"
    p.write_text("1 10\n2 -20\n")
    for _ in range(2):
        with pytest.raises(MappingError, match="line 2: body id '-20' is negative"):
            fm.load_file(p)
        rt.clear_cache()
    assert [f.suffix for f in cache.iterdir() if not f.name.endswith(".lock")] == [".error"]


def test_prepare_parses_in_a_child_process(tmp_path, cache):
    p, sv, body = _mapping_file(tmp_path, seed=1)
    fm.prepare_file(p)
    assert rt.cache_info()["parsed"] == 0  # not in this process
    np.testing.assert_array_equal(fm.load_file(p)(sv), body)
    assert rt.cache_info() == {"parsed": 0, "built": 1, "opened": 2, "hits": 0, "entries": 1}
    bad = tmp_path / "bad.txt"
    bad.write_text("1 10\n0 42\n")
    with pytest.raises(MappingError, match="line 2 maps supervoxel 0 to body 42"):
        fm.prepare_file(bad)


def test_the_disk_cache_can_be_off(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("DVIDSHARDS_CACHE_DIR", "off")
    p, sv, body = _mapping_file(tmp_path, n=100)
    np.testing.assert_array_equal(fm.load_file(p)(sv), body)
    fm.prepare_file(p)
    assert not cache.exists() and rt.cache_info()["parsed"] == 1


def test_mapped_file_pickles_as_its_path_and_fails_when_the_file_changed(tmp_path, cache):
    from dvidshards.formats.labels import Mapped, as_labels

    p, sv, body = _mapping_file(tmp_path, n=20_000)
    src = as_labels(str(p))
    assert isinstance(src, Mapped) and rt.cache_info()["parsed"] == 0  # nothing read yet
    ident = src.identity()
    assert ident == {"labels": "mapped", "mapping_file": str(p), "mapping_bytes": p.stat().st_size,
                     "mapping_mtime_ns": p.stat().st_mtime_ns, "mapping_format": "auto"}
    assert rt.cache_info()["parsed"] == 0  # the identity reads nothing either
    blob = pickle.dumps(src)
    assert len(blob) < 400 < 16 * 20_000  # by reference
    again = pickle.loads(blob)
    assert again == src and hash(again) == hash(src)
    np.testing.assert_array_equal(again.mapping(sv), body)
    obj = Mapped({5: 50})
    assert len(pickle.dumps(obj)) > 0 and pickle.loads(pickle.dumps(obj)).mapping(np.array([5], np.uint64)) == [50]
    assert obj.identity()["labels"] == "mapped" and len(obj.identity()["mapping_sha256"]) == 64
    p.write_text("1 10\n")  # the file changes after planning
    with pytest.raises(MappingError, match="changed after the job was planned"):
        pickle.loads(blob).load()


# --- mapping files as users have them: text with headers, binary, compressed, empty ------------------


def test_a_text_mapping_of_16_bytes_is_text(tmp_path):
    p = tmp_path / "m.txt"
    p.write_bytes(b"1 10\n2 20\n33 30\n")
    assert len(p.read_bytes()) == 16
    m = LabelMapping.from_file(p)
    np.testing.assert_array_equal(m(np.array([1, 2, 33, 4], np.uint64)), [10, 20, 30, 4])


@pytest.mark.parametrize("text", ["sv_id,body_id\n1,10\n2,20\n", "# comment\n1\t10\n2\t20\n", "1, 10\n2 ,20\n"])
def test_a_mapping_with_header_tab_or_comment(tmp_path, text):
    p = tmp_path / "m.csv"
    p.write_text(text)
    m = LabelMapping.from_file(p)
    np.testing.assert_array_equal(m(np.array([1, 2, 3], np.uint64)), [10, 20, 3])


def test_a_negative_id_names_the_line(tmp_path):
    p = tmp_path / "m.txt"
    p.write_text("1 10\n2 20\n-3 30\n")
    with pytest.raises(MappingError, match="line 3") as e:
        LabelMapping.from_file(p)
    assert "-3" in str(e.value) and str(p) in str(e.value)


def test_a_series_with_nan_or_float_keys():
    pd = pytest.importorskip("pandas")
    with pytest.raises(MappingError, match="nan|NaN"):
        LabelMapping.from_any(pd.Series([10.0, np.nan], index=[1, 2]))
    with pytest.raises(MappingError, match="1.7"):
        LabelMapping.from_any(pd.Series([10, 20], index=[1.7, 2.0]))
    with pytest.raises(MappingError, match="1.7"):
        LabelMapping.from_any({1.7: 10})


def test_a_binary_mapping_only_when_it_cannot_be_text(tmp_path):
    p = tmp_path / "m.bin"
    pairs = np.array([[1, 10], [2, 20]], "<u8")
    p.write_bytes(pairs.tobytes())
    m = LabelMapping.from_file(p)
    np.testing.assert_array_equal(m(np.array([1, 2, 3], np.uint64)), [10, 20, 3])
    m = LabelMapping.from_file(p, format="binary")
    np.testing.assert_array_equal(m(np.array([1, 2], np.uint64)), [10, 20])


BOX = [[0, 0, 0], [130, 100, 70]]


def _text(ex) -> bytes:
    """The export's own mapping as DVID's /mappings text, with its bodies changed (so that a read
    that ignored the file would be told apart)."""
    m = np.asarray(ex.mapping)
    return b"".join(b"%d %d\n" % (a, b + 1000 if b else 0) for a, b in m.tolist())


def _remapped(ex) -> np.ndarray:
    m = np.asarray(ex.mapping, np.uint64).copy()
    m[:, 1] = np.where(m[:, 1] != 0, m[:, 1] + np.uint64(1000), 0)
    (x0, y0, z0), (x1, y1, z1) = BOX
    return ex.expected(0, m)[x0:x1, y0:y1, z0:z1]


def _read_both(ex, path) -> tuple[np.ndarray, np.ndarray]:
    (x0, y0, z0), (x1, y1, z1) = BOX
    vol = dvidshards.open(ex.root, spec=ex.spec, labels=str(path))
    a = vol[x0:x1, y0:y1, z0:z1].read().result()
    b = Dataset(ex.root, spec=ex.spec).read(BOX, scale=0, labels=str(path))
    return a, b


def test_a_gzip_compressed_mapping_file_is_read(synthetic_export, tmp_path):
    """``labels="mappings.txt.gz"`` reads as the text it holds, also when the compressed length is
    a multiple of 16 (once read as binary pairs: garbage, no error); the same for zstd, and for
    binary pairs inside gzip."""
    import zstandard

    text = _text(synthetic_export)
    pad = 0
    while len(gzip.compress(text + b"#" * pad + b"\n", mtime=0)) % 16:
        pad += 1
    gz = gzip.compress(text + b"#" * pad + b"\n", mtime=0)
    assert len(gz) % 16 == 0
    want = _remapped(synthetic_export)
    pairs = np.array([[int(t) for t in line.split()] for line in text.splitlines()], "<u8").tobytes()
    for name, data in (("mappings.txt.gz", gz), ("mappings.txt.zst", zstandard.ZstdCompressor().compress(text)),
                       ("mappings.bin.gz", gzip.compress(pairs)), ("named-as-text.txt", gz)):
        p = tmp_path / name
        p.write_bytes(data)
        a, b = _read_both(synthetic_export, p)
        np.testing.assert_array_equal(a, want, err_msg=name)
        np.testing.assert_array_equal(b, want, err_msg=name)


@pytest.mark.parametrize("name,data,match", [
    ("mappings.txt.lz4", b"\x04\x22\x4d\x18" + b"\x00" * 28, "is lz4-compressed, which is not read here"),
    ("mappings.zip", b"PK\x03\x04" + b"\x00" * 28, "is a zip archive, which is not read here"),
    ("mappings.txt.gz", None, "gzip-compressed mapping file is damaged or incomplete"),
])
def test_a_compressed_mapping_that_cannot_be_read_is_refused_by_name(synthetic_export, tmp_path, name, data, match):
    if data is None:  # a download cut short
        data = gzip.compress(_text(synthetic_export) * 20)[:-100]
    p = tmp_path / name
    p.write_bytes(data)
    for read in (lambda: _read_both(synthetic_export, p), lambda: dvidshards.LabelMapping.from_file(p)):
        with pytest.raises(MappingError, match=match) as e:
            read()
        assert str(p) in str(e.value) and "16-byte" not in str(e.value)


def test_an_empty_mapping_file_is_a_mapping_error_naming_the_file(synthetic_export, tmp_path):
    """A mapping file of 0 bytes (an interrupted download) is an error, never "nothing mapped"
    (which read every voxel as its supervoxel)."""
    p = tmp_path / "mappings.txt"
    p.write_bytes(b"")
    with pytest.raises(MappingError, match="the mapping file is empty") as e:
        _read_both(synthetic_export, p)
    assert str(p) in str(e.value)
    gz = tmp_path / "mappings.txt.gz"
    gz.write_bytes(gzip.compress(b""))
    with pytest.raises(MappingError, match="decompresses to 0 bytes") as e:
        _read_both(synthetic_export, gz)
    assert str(gz) in str(e.value)
    header = tmp_path / "nothing.txt"  # a mapping of nothing, said so
    header.write_bytes(b"sv body\n")
    a, b = _read_both(synthetic_export, header)
    (x0, y0, z0), (x1, y1, z1) = BOX
    np.testing.assert_array_equal(a, synthetic_export.expected(0, "supervoxels")[x0:x1, y0:y1, z0:z1])
