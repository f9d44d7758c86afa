"""README.md's Python code runs as written, and so does examples/quickstart.py.

Every ```python block of the README is executed on its own, in a fresh namespace, in the order
of the file: a user who copies one block gets a program that runs. ```bash and plain ```
blocks (signatures, the mask rules, the layout) are not executed. The tests run on the CPU
(8 host devices, tests/conftest.py), so the snippets use small shapes.
"""
import importlib.util
import os
import re

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
README = os.path.join(ROOT, "README.md")

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(text):
  """(first line number, source) of every ```python block of a markdown text."""
  return [(text.count("\n", 0, m.start()) + 2, m.group(2)) for m in _FENCE.finditer(text) if m.group(1) == "python"]


with open(README) as _f:
  BLOCKS = python_blocks(_f.read())


def test_readme_has_python_blocks():
  assert len(BLOCKS) >= 6, BLOCKS


def test_fence_parser():
  text = "a\n```python\nx = 1\n```\n\n```bash\nls\n```\n```python\ny = 2\n\nz = 3\n```\n"
  assert python_blocks(text) == [(3, "x = 1\n"), (10, "y = 2\n\nz = 3\n")]


@pytest.mark.parametrize("line, source", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_block_runs(cpu_devices, line, source):
  code = compile(source, f"README.md:{line}", "exec")
  exec(code, {"__name__": "__readme__"})  # noqa: S102 -- the README's own code


def test_quickstart_runs(cpu_devices, capsys):
  """examples/quickstart.py passes: the CPU kernels ran (read from the compiled program) and
  agree with the reference."""
  spec = importlib.util.spec_from_file_location("quickstart", os.path.join(ROOT, "examples", "quickstart.py"))
  quickstart = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(quickstart)
  assert quickstart.main() == 0, capsys.readouterr().out
  out = capsys.readouterr().out
  assert "implementation: cpu" in out and out.rstrip().endswith("OK"), out
