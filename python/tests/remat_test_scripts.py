"""The repository's scripts (scripts/*.py) loaded as modules for the tests that check them
(not a test module): the doc-example runner and the Python reference generator."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_script(name: str):
    """scripts/{name}.py as the module ``name`` (registered in ``sys.modules``, so that
    dataclasses and the scripts' own imports of each other resolve)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
