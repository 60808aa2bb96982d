"""The quickstart notebook runs top to bottom."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs notebooks in a Jupyter kernel

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_executes(dvid_data, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend shows figures
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "exact: True" in outputs
    assert "body size exact: True" in outputs and "faces" in outputs  # the Body API: size, sparsevol, mesh
    assert "real bodies in this slab" in outputs
    assert any(o.get("output_type") == "display_data" for c in nb.cells for o in c.get("outputs", []))
