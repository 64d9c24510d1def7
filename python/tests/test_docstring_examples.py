"""The examples (``>>>``) in the docstrings of ``remat`` (the package's front page and
``human_bytes``) and of ``remat.bench`` run as written and print what they say. Examples
marked ``+SKIP`` are the whole benchmark, which ``test_bench.py`` runs."""

from __future__ import annotations

import doctest

import pytest


def _run(module) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                             verbose=False, report=True)
    assert result.attempted > 0, f"{module.__name__}: no docstring examples found"
    assert result.failed == 0, f"{module.__name__}: {result.failed} docstring examples failed"


def test_remat_docstring_examples():
    import remat

    _run(remat)


def test_bench_docstring_examples():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("torchvision")
    import remat.bench

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _run(remat.bench)
    finally:
        torch.set_num_threads(threads)
