"""Every line of README.md's Python block runs: on a small workspace laid out under the README's own
names (export/, pyramid/, table/, mappings.txt.gz, ...), with only the mCNS coordinates and ids swapped
for ones of the synthetic export (and the cloud URL for a local copy of the export)."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np
import pytest

import dvidshards
from dvidshards.demo.neurons import neuron_volume

ROOT = Path(__file__).resolve().parents[1]


def _readme_python() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """export/ (s0 only, the spec listing three scales, as DVID writes by default), its spec file,
    a mapping file, a table, idx/ and the names the README's lines use for bytes and records."""
    sv, mapping = neuron_volume((192, 160, 96), n_bodies=6, svs_per_body=3, seed=11)
    spec = dvidshards.write_export(sv, tmp_path / "export", mapping=mapping, scales=3, shard_chunks=1,
                                   only_scales=[0])
    (tmp_path / "mcns-ng-specs.json").write_text(json.dumps(spec))
    (tmp_path / "specs.json").write_text(json.dumps(spec))
    with gzip.open(tmp_path / "mappings.txt.gz", "wt") as f:
        f.writelines(f"{a} {b}\n" for a, b in mapping)
    (tmp_path / "mappings.txt").write_text("".join(f"{a} {b}\n" for a, b in mapping))
    monkeypatch.chdir(tmp_path)
    return sv, mapping, spec


def test_every_readme_python_line_runs(workspace, tmp_path):
    pytest.importorskip("zmesh")
    pytest.importorskip("dask.array")
    pytest.importorskip("kimimaro")
    sv, mapping, spec = workspace
    from dvidshards.jobs.downsample import downsample
    from dvidshards.jobs.ingest import ingest

    downsample("export/", "pyramid/", spec=spec, progress=False)  # the README's pyramid/ (made again below)
    ingest("export/", "table/", spec=spec, workers=1, progress=False)
    from dvidshards.cli import main

    assert main(["consolidate", "export/", "--spec", "mcns-ng-specs.json", "--out", "idx/"]) == 0
    both = dvidshards.Dataset(["export/", "pyramid/"], spec=spec)
    body = int(np.unique(both.read([[0, 0, 0], list(both.scale(1).size)], scale=1))[-1])
    origin = both.shards(1)[0]
    import pyarrow as pa

    first = dvidshards.Dataset("export/", spec=spec).shards(0)[0]
    table0 = dvidshards.Dataset("export/", spec=spec).shard(0, first).table()
    stem = "export/s0/{}_{}_{}".format(*first)
    records = pa.ipc.open_stream(Path(stem + ".arrow").read_bytes()).read_all().to_pylist()
    ns: dict = {"spec": spec, "raw": table0.block(0), "vol_xyz": sv, "records": records}
    swaps = [
        ("30000:30512, 25000:25512, 28000:28064", "0:128, 0:128, 0:64"),
        ('"gs://bucket/export/"', '"export/"'),
        ("scale=3, spec=spec", "scale=2, spec=spec"),
        ("1497920602", str(body)),
        ("(30720, 24576, 28672)", str(tuple(int(v) for v in origin))),
        ('dvidshards.Dataset("export/", spec="mcns-ng-specs.json")',
         'dvidshards.Dataset(["export/", "pyramid/"], spec="mcns-ng-specs.json")'),
        ('downsample("export/", "pyramid/", spec="mcns-ng-specs.json")',
         'downsample("export/", "pyramid2/", spec="mcns-ng-specs.json", progress=False)'),
        ('"out/s0/0_0_0"', '"out2/s0/0_0_0"'),
        ('spec = dvidshards.write_export(', 'spec_out = dvidshards.write_export('),  # keep export/'s spec
        ('convert("export/", "out/", format="precomputed", spec=spec)',
         'convert("export/", "conv/", format="precomputed", spec=spec, progress=False)'),
        ("[[0, 0, 0], [512, 512, 64]]", "[[0, 0, 0], [128, 128, 64]]"),
        ("[[100, 200, 30], [5, 6, 7]]", "[[100, 120, 30], [5, 6, 7]]"),
    ]
    ran = 0
    for line in _readme_python():
        code = line.split("  #", 1)[0].rstrip()
        for a, b in swaps:
            code = code.replace(a, b)
        try:
            exec(code, ns)
        except Exception as e:
            raise AssertionError(f"README line does not run: {line.strip()}\n  as: {code}\n  {type(e).__name__}: {e}") from e
        ran += 1
    assert ran >= 30
    assert ns["report"].ok and ns["ds"].exported == (0, 1, 2) and ns["b"].exists()
    assert len(ns["sk"].vertices) and ns["sk"].swc().count("\n") >= len(ns["sk"].vertices)
    np.testing.assert_array_equal(ns["a"], ns["ds"].read([[0, 0, 0], [128, 128, 64]], scale=0))


def _readme_commands() -> list[str]:
    """Every ``dvidshards ...`` line of README.md's bash blocks, its comment cut off."""
    text = (ROOT / "README.md").read_text()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            code = line.split("  #", 1)[0].strip()
            if code.startswith("dvidshards "):
                lines.append(code)
    return lines


def test_every_readme_command_parses_with_the_options_it_shows():
    """Each command the README shows is one of the CLI's, with options its parser takes (an option
    that was renamed or removed fails here, naming the README line)."""
    import shlex

    from dvidshards.cli import UsageError, build_parser

    lines = _readme_commands()
    assert len(lines) >= 20, lines
    shown = set()
    for line in lines:
        argv = shlex.split(line)[1:]
        shown.add(argv[0])
        try:
            args = build_parser(argv[0]).parse_args(argv)
        except (UsageError, SystemExit) as e:
            raise AssertionError(f"README command does not parse: {line}\n  {type(e).__name__}: {e}") from e
        assert args.command == argv[0]
    from dvidshards.cli import COMMANDS

    assert set(COMMANDS) - shown == set(), f"commands the README never shows: {sorted(set(COMMANDS) - shown)}"
