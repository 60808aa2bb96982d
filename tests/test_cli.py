"""The command line: info, demo."""

from __future__ import annotations

import json

import numpy as np

from dvidshards.cli import main
from dvidshards.demo import label_colors, run_demo, write_png


def test_info(synthetic_export, tmp_path, capsys):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(synthetic_export.spec))
    assert main(["info", synthetic_export.root, "--spec", str(spec)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["0", "1", "2"]
    assert rows[0][2] == "x".join(map(str, synthetic_export.sv.shape)) and rows[0][4] == "128"
    n_chunks = len({tuple(c) for c in np.argwhere(synthetic_export.sv) // 64})
    assert int(rows[0][6]) == n_chunks and rows[0][-1] == "A"
    assert main(["info", str(tmp_path / "nowhere")]) == 2
    assert "SpecError" in capsys.readouterr().err


def test_demo(tmp_path):
    lines = []
    res = run_demo(str(tmp_path), size=(384, 320, 224), echo=lines.append)
    text = "\n".join(lines)
    assert text.count("exact: True") == 2, text
    png = open(res["png"], "rb").read()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
    assert res["agglomerated"].shape == res["supervoxels"].shape
    assert len(np.unique(res["supervoxels"])) > len(np.unique(res["agglomerated"]))


def test_png_and_colors(tmp_path):
    rgb = label_colors(np.array([[0, 1], [2, 1]], np.uint64))
    assert (rgb[0, 0] == 0).all() and (rgb[0, 1] == rgb[1, 1]).all() and (rgb[0, 1] != rgb[1, 0]).any()
    write_png(str(tmp_path / "x.png"), rgb)
    assert (tmp_path / "x.png").read_bytes()[12:16] == b"IHDR"
