"""README stays true: every ```python block runs (on the packaged lily-tiny), and the set-up is two commands."""

import contextlib
import io
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), flags=re.S | re.M)


def test_readme_has_python_blocks_and_exactly_two_setup_commands():
    assert len(BLOCKS) >= 2
    text = README.read_text(encoding="utf-8")
    commands = [line.strip() for line in text.splitlines() if line.startswith("    ") and not line.startswith("     ")
                and line.strip().startswith(("pip ", "python "))]
    assert commands == ['pip install . && python -m lily generate "def read_lines(path):" --max-tokens 48',
                        'pip install ".[test]" && python -m pytest -q tests']
    assert "```bash" not in text and "```sh" not in text


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # snippets may write files (s.save)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(BLOCKS[index], f"README.md python block {index + 1}", "exec"), {"__name__": "__readme__"})
    assert out.getvalue().strip()  # every block shows something
