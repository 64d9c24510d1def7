"""The README's Python example runs as written (the first ```python block of its Python
section), and its claims about that example hold: the plan recomputes, and fits."""

from __future__ import annotations

import os
import re

import pytest

torch = pytest.importorskip("torch")

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def python_block() -> str:
    text = open(README, encoding="utf-8").read()
    section = text[text.index("## Python\n"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_python_example_runs(capsys):
    torch.set_num_threads(1)
    scope: dict = {}
    exec(compile(python_block(), "README.md", "exec"), scope)
    import remat.torch

    plan = remat.torch.controller(scope["model"]).plan
    assert plan is not None and plan.count("recompute") > 0
    assert plan.predicted_peak <= plan.budget_bytes
    assert "predicted peak" in capsys.readouterr().out
