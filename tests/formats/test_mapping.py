"""Label mappings: every accepted form, DVID's /mappings files, and bad input."""

from __future__ import annotations

import numpy as np
import pytest

from dvidshards import LabelMapping, MappingError

SV = np.array([5, 1 << 40, 7, 0, 9], np.uint64)


def _check(m):
    np.testing.assert_array_equal(m.palette(SV), [50, 11, 7, 0, 9])  # unmapped ids keep their id


def test_forms(tmp_path):
    _check(LabelMapping.from_any({5: 50, 1 << 40: 11}))
    _check(LabelMapping.from_any(np.array([[5, 50], [1 << 40, 11]], np.uint64)))
    _check(LabelMapping.from_any([[5, 50], [1 << 40, 11], [5, 50]]))  # a repeated identical pair is fine
    pd = pytest.importorskip("pandas")
    _check(LabelMapping.from_any(pd.Series([50, 11], index=pd.Index([5, 1 << 40], dtype="uint64"), dtype="uint64")))


def test_dvid_mapping_files(tmp_path):
    text = tmp_path / "m.txt"
    text.write_text(f"5 50\n{1 << 40}\t11\n\n# comment\n")
    _check(LabelMapping.from_file(text))
    binary = tmp_path / "m.bin"
    binary.write_bytes(np.array([[5, 50], [1 << 40, 11]], "<u8").tobytes())
    _check(LabelMapping.from_any(str(binary)))


def test_maps_arrays_of_any_shape():
    m = LabelMapping.from_any({5: 50})
    np.testing.assert_array_equal(m(np.array([[5, 6], [0, 5]])), [[50, 6], [0, 50]])


@pytest.mark.parametrize("obj,match", [
    ({5: 50, 6: 60, 7: 70} | {}, None),
    (np.array([[5, 50], [5, 51]]), "mapped to both"),
    (np.array([[-1, 5]]), "negative"),
    (np.array([1, 2, 3]), r"\(n, 2\)"),
    (object(), "must be"),
])
def test_bad_mappings(obj, match):
    if match is None:
        assert len(LabelMapping.from_any(obj)) == 3
        return
    with pytest.raises(MappingError, match=match):
        LabelMapping.from_any(obj)


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("5 50\n6 sixty\n")
    with pytest.raises(MappingError, match="line 2"):
        LabelMapping.from_file(bad)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00\xff" * 9)
    with pytest.raises(MappingError, match="whole number"):
        LabelMapping.from_file(odd)
    with pytest.raises(MappingError, match="cannot read"):
        LabelMapping.from_file(tmp_path / "absent.txt")
