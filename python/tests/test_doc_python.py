"""Every ```python block of the README and the user guide (docs/src) runs as written: one
test per block, its id the page and the line of the block's fence.

Each block runs on its own in a fresh temporary directory (its working directory), with one
torch thread, the repository's ``target/release`` first on PATH (blocks may run the
``remat`` command to make their input files, as the shell examples do). A block that cannot
run is marked ``python,no-run: WHY`` and is reported as skipped with that reason; the
classification of blocks is scripts/doc_examples.py's, which the shell examples use too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from remat_test_scripts import REPO, load_script


RUNNER = load_script("doc_examples")
BLOCKS = [b for b in RUNNER.blocks(REPO) if b.lang in RUNNER.PYTHON]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_doc_python_block(block, tmp_path, monkeypatch):
    if block.marker_error:
        pytest.fail(f"{block.where}: {block.marker_error}")
    if block.no_run is not None:
        pytest.skip(f"no-run: {block.no_run}")
    torch = pytest.importorskip("torch")
    binary_dir = REPO / "target" / "release"
    if "remat" in block.code and "subprocess" in block.code and not (binary_dir / "remat").is_file():
        pytest.skip("the block runs the remat command: cargo build --release -p remat-cli first")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{binary_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = compile(block.code, block.where, "exec")
        exec(code, {"__name__": "__doc_example__"})
    finally:
        torch.set_num_threads(threads)
        remove = [name for name in sys.modules if name == "__doc_example__"]
        for name in remove:
            del sys.modules[name]


def test_every_python_block_is_found():
    """The README's quick start is among the blocks (a parser that found nothing would
    make every test above vanish)."""
    assert any(b.path == Path("README.md") and b.kind == "python" for b in BLOCKS)
