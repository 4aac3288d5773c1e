"""notebooks/decode_loop.ipynb runs top to bottom on the CPU (so it cannot rot)."""

import os
import re

import nbformat
from nbclient import NotebookClient

NOTEBOOK = os.path.join(os.path.dirname(__file__), "..", "notebooks", "decode_loop.ipynb")


def test_decode_loop_notebook_executes():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}}
    ).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    tau = float(re.search(r"mean accept length tau = ([\d.]+)", outputs).group(1))
    assert tau > 1.2, outputs  # the embedded pair is trained: its drafts are accepted (random weights give 1)
