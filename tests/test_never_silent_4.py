"""Issue 31 (never silent, round 4): each case as a user met it, named after the issue's item.

Items 1 and 2 (a compressed mapping file, an empty one) and 8 (a fork after TensorStore started).
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import dvidshards
from dvidshards import Dataset, MappingError
from tests.conftest import make_export

ROOT = Path(__file__).resolve().parents[1]
BOX = [[0, 0, 0], [130, 100, 70]]


@pytest.fixture(scope="module")
def ex(tmp_path_factory):
    return make_export(tmp_path_factory.mktemp("ns4") / "exp", (200, 130, 90), seed=11, scales=1)


def _text(ex) -> bytes:
    """The export's own mapping as DVID's /mappings text, with its bodies changed (so that a read
    that ignored the file would be told apart)."""
    m = np.asarray(ex.mapping)
    return b"".join(b"%d %d\n" % (a, b + 1000 if b else 0) for a, b in m.tolist())


def _want(ex) -> np.ndarray:
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


def test_31_1_a_gzip_compressed_mapping_file_is_read(ex, tmp_path):
    """``labels="mappings.txt.gz"`` reads as the text it holds, also when the compressed length is
    a multiple of 16 (once read as binary pairs: garbage, no error); the same for zstd, and for
    binary pairs inside gzip."""
    import zstandard

    text = _text(ex)
    pad = 0
    while len(gzip.compress(text + b"#" * pad + b"\n", mtime=0)) % 16:
        pad += 1
    gz = gzip.compress(text + b"#" * pad + b"\n", mtime=0)
    assert len(gz) % 16 == 0
    want = _want(ex)
    pairs = np.array([[int(t) for t in line.split()] for line in text.splitlines()], "<u8").tobytes()
    for name, data in (("mappings.txt.gz", gz), ("mappings.txt.zst", zstandard.ZstdCompressor().compress(text)),
                       ("mappings.bin.gz", gzip.compress(pairs)), ("named-as-text.txt", gz)):
        p = tmp_path / name
        p.write_bytes(data)
        a, b = _read_both(ex, p)
        np.testing.assert_array_equal(a, want, err_msg=name)
        np.testing.assert_array_equal(b, want, err_msg=name)


@pytest.mark.parametrize("name,data,match", [
    ("mappings.txt.lz4", b"\x04\x22\x4d\x18" + b"\x00" * 28, "is lz4-compressed, which is not read here"),
    ("mappings.zip", b"PK\x03\x04" + b"\x00" * 28, "is a zip archive, which is not read here"),
    ("mappings.txt.gz", None, "gzip-compressed mapping file is damaged or incomplete"),
])
def test_31_1_a_compressed_mapping_that_cannot_be_read_is_refused_by_name(ex, tmp_path, name, data, match):
    if data is None:  # a download cut short
        data = gzip.compress(_text(ex) * 20)[:-100]
    p = tmp_path / name
    p.write_bytes(data)
    for read in (lambda: _read_both(ex, p), lambda: dvidshards.LabelMapping.from_file(p)):
        with pytest.raises(MappingError, match=match) as e:
            read()
        assert str(p) in str(e.value) and "16-byte" not in str(e.value)


def test_31_2_an_empty_mapping_file_is_a_mapping_error_naming_the_file(ex, tmp_path):
    """A mapping file of 0 bytes (an interrupted download) is an error, never "nothing mapped"
    (which read every voxel as its supervoxel)."""
    p = tmp_path / "mappings.txt"
    p.write_bytes(b"")
    with pytest.raises(MappingError, match="the mapping file is empty") as e:
        _read_both(ex, p)
    assert str(p) in str(e.value)
    gz = tmp_path / "mappings.txt.gz"
    gz.write_bytes(gzip.compress(b""))
    with pytest.raises(MappingError, match="decompresses to 0 bytes") as e:
        _read_both(ex, gz)
    assert str(gz) in str(e.value)
    header = tmp_path / "nothing.txt"  # a mapping of nothing, said so
    header.write_bytes(b"sv body\n")
    a, b = _read_both(ex, header)
    (x0, y0, z0), (x1, y1, z1) = BOX
    np.testing.assert_array_equal(a, ex.expected(0, "supervoxels")[x0:x1, y0:y1, z0:z1])


_FORK = textwrap.dedent("""
    import json, multiprocessing, sys, warnings
    import dvidshards

    root, spec = sys.argv[1], json.loads(sys.argv[2])
    vol = dvidshards.open(root, spec=spec)

    def read_again(_):
        return int(vol[0:64, 0:64, 0:64].read().result().max())

    def open_and_read(_):
        v = dvidshards.open(root, spec=spec)
        return int(v[64:128, 0:64, 0:64].read().result().max())

    def no_tensorstore(x):
        return x * 2

    if __name__ == "__main__":
        first = int(vol[0:64, 0:64, 0:64].read().result().max())  # TensorStore's threads run now
        out = {"first": first}
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with multiprocessing.get_context("fork").Pool(1) as pool:
                for f in (read_again, open_and_read):
                    try:
                        out[f.__name__] = ["ok", pool.apply_async(f, (0,)).get(timeout=120)]
                    except multiprocessing.TimeoutError:
                        out[f.__name__] = ["hang"]
                    except Exception as e:
                        out[f.__name__] = [type(e).__name__, str(e)]
                out["other work"] = pool.apply_async(no_tensorstore, (21,)).get(timeout=120)
        out["warnings"] = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
        print(json.dumps(out))
""")


@pytest.mark.skipif(not hasattr(os, "fork") or not sys.platform.startswith("linux"), reason="Linux: fork")
def test_31_8_a_fork_pool_after_tensorstore_started_fails_with_a_clear_error_not_a_hang(ex, tmp_path):
    """multiprocessing's default 'fork' pool after a read: each task that needs TensorStore fails in
    the parent with ForkError naming the fix (the 'spawn' start method) instead of the child
    aborting and pool.apply waiting forever; the parent was warned once; other work still runs."""
    r = subprocess.run([sys.executable, "-c", _FORK, ex.root, json.dumps(ex.spec)], capture_output=True,
                       text=True, timeout=600, cwd=str(tmp_path), env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["first"] > 0
    for f in ("read_again", "open_and_read"):
        assert out[f][0] == "ForkError", out
        assert "forked" in out[f][1] and "get_context('spawn')" in out[f][1], out
    assert out["other work"] == 42
    assert len(out["warnings"]) == 1 and "spawn" in out["warnings"][0], out["warnings"]
