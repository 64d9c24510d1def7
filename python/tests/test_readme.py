"""The README's PyTorch quick start runs as written (the first ```python block of its
"Quick start 1" section), and its claims about that example hold: the plan recomputes, fits
its budget, and the printed table is the one the text describes. (Every Python block of the
README and the guide also runs in test_doc_python.py; this test checks what the README says
of its own.)"""

from __future__ import annotations

import os
import re

import pytest

torch = pytest.importorskip("torch")

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def python_block() -> str:
    text = open(README, encoding="utf-8").read()
    section = text[text.index("## Quick start 1"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_python_example_runs(capsys):
    torch.set_num_threads(1)
    scope: dict = {}
    exec(compile(python_block(), "README.md", "exec"), scope)
    import remat.torch

    plan = remat.torch.controller(scope["model"]).plan
    assert plan is not None and plan.count("recompute") > 0
    assert plan.predicted_peak <= plan.budget_bytes
    out = capsys.readouterr().out
    assert "predicted peak" in out
    for column in ("kept", "offloaded", "recomputed"):
        assert column in out
