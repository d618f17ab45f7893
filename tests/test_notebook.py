"""examples/quickstart.ipynb runs top to bottom on lily-tiny (so it cannot rot)."""

import json
import pathlib
import sys

import pytest

NOTEBOOK = pathlib.Path(__file__).resolve().parent.parent / "examples" / "quickstart.ipynb"


def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    pytest.importorskip("ipykernel", reason="ipykernel (the test extra) is not installed: no kernel to run on")
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    # A kernel spec for this interpreter, so the notebook runs against the lily under test.
    spec = tmp_path / "kernels" / "lily-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "lily tests", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, kernel_name="lily-test", timeout=300, resources={"metadata": {"path": str(tmp_path)}}).execute()

    outputs = [c.get("outputs", []) for c in nb.cells if c.cell_type == "code"]
    assert not any(o.get("output_type") == "error" for cell in outputs for o in cell)
    html = [o["data"]["text/html"] for cell in outputs for o in cell if "text/html" in o.get("data", {})]
    assert any("lily.Engine" in h for h in html) and any("lily engine report" in h for h in html)
    assert any("lily.Session" in h for h in html)
    text = "".join(o.get("text", "") for cell in outputs for o in cell if o.get("output_type") == "stream")
    assert "Generation:" in text and "prefill" in text  # verbose generate, and the prefill bar
    final = [o["data"]["text/plain"] for o in outputs[2] if "text/plain" in o.get("data", {})]
    assert final and "GenerationResponse(" in final[0] and "finish_reason=" in final[0]
