"""A fork after TensorStore started: a clear error in the child, a warning in the parent, never a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

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
def test_a_fork_pool_after_tensorstore_started_fails_with_a_clear_error_not_a_hang(synthetic_export, tmp_path):
    """multiprocessing's default 'fork' pool after a read: each task that needs TensorStore fails in
    the parent with ForkError naming the fix (the 'spawn' start method) instead of the child
    aborting and pool.apply waiting forever; the parent was warned once; other work still runs."""
    r = subprocess.run([sys.executable, "-c", _FORK, synthetic_export.root, json.dumps(synthetic_export.spec)], capture_output=True,
                       text=True, timeout=600, cwd=str(tmp_path), env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["first"] > 0
    for f in ("read_again", "open_and_read"):
        assert out[f][0] == "ForkError", out
        assert "forked" in out[f][1] and "get_context('spawn')" in out[f][1], out
    assert out["other work"] == 42
    assert len(out["warnings"]) == 1 and "spawn" in out["warnings"][0], out["warnings"]
