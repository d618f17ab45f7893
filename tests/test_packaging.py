"""Distribution metadata (lily-inference, the lily command) and the wheel checker used by .ci/run."""

import importlib.metadata
import pathlib
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import check_wheel  # noqa: E402


def test_installed_distribution_is_lily_inference_with_the_lily_command():
    meta = importlib.metadata.metadata("lily-inference")
    assert meta["Name"] == "lily-inference"
    assert "Typing :: Typed" in meta.get_all("Classifier")
    dist = importlib.metadata.distribution("lily-inference")
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert scripts == {"lily": "lily.cli:main"}
    assert {"test", "bench"} <= set(meta.get_all("Provides-Extra"))


def _wheel(path, names, name="lily-inference"):
    with zipfile.ZipFile(path, "w") as z:
        for n in names:
            z.writestr(n, b"x")
        z.writestr("lily_inference-0.1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\n\nREADME\nName: lily\n")
    return path


FULL = ["lily/__init__.py", "lily/_core.cpython-311-x86_64-linux-gnu.so", "lily/py.typed",
        "lily/models/lily-tiny/config.json", "lily/models/lily-tiny/model.safetensors",
        "lily/models/lily-tiny/tokenizer.json"]


def test_wheel_checker_finds_what_is_missing(tmp_path):
    assert check_wheel.check(_wheel(tmp_path / "ok.whl", FULL)) == []
    problems = check_wheel.check(_wheel(tmp_path / "bad.whl", [n for n in FULL if "py.typed" not in n
                                                               and "safetensors" not in n], name="lily"))
    assert len(problems) == 3
    assert any("py.typed" in p for p in problems) and any("safetensors" in p for p in problems)
    assert any("Name: lily-inference" in p for p in problems)
