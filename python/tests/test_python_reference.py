"""The guide's Python API reference (docs/src/reference/python.md) is generated from the
docstrings by scripts/python_reference.py; this fails when the checked-in page is stale
(regenerate: ``python scripts/python_reference.py``), and checks that every public name
of ``remat`` and ``remat.torch`` has a docstring there."""

from __future__ import annotations


import pytest

pytest.importorskip("torch")  # the page documents remat.torch too

from remat_test_scripts import REPO, load_script


def _generator():
    return load_script("python_reference")


def test_reference_page_is_current():
    gen = _generator()
    fresh = gen.generate()
    current = gen.PAGE.read_text(encoding="utf-8")
    assert current == fresh, (
        "docs/src/reference/python.md is stale: run `python scripts/python_reference.py`")


def test_every_public_name_has_a_docstring():
    import remat
    import remat.torch

    missing = [f"{m.__name__}.{name}" for m in (remat, remat.torch) for name in m.__all__
               if not (getattr(m, name).__doc__ or "").strip()]
    assert not missing, f"public names without a docstring: {missing}"


def test_markdown_turns_parameters_into_a_list_and_marks_fences():
    gen = _generator()
    doc = "Does a thing.\n\nsize: how big, in\n    bytes.\n\n```python\nx = 1\n```\n"
    text = gen.markdown(doc, ("size",))
    assert "- `size`: how big, in bytes." in text
    assert "```python,no-run: an example from a docstring" in text


def _has_example(obj) -> bool:
    doc = obj.__doc__ or ""
    return ">>>" in doc or "```" in doc


def test_every_name_of_the_front_page_and_the_bench_has_an_example():
    """remat.human_bytes and every public name of remat.bench show their use (the examples
    run in test_docstring_examples.py)."""
    import remat
    import remat.bench

    names = [("remat", "human_bytes", remat.human_bytes)]
    names += [("remat.bench", n, getattr(remat.bench, n)) for n in remat.bench.__all__]
    missing = [f"{m}.{n}" for m, n, obj in names if not _has_example(obj)]
    assert not missing, f"public names without an example in their docstring: {missing}"


def test_every_public_name_has_an_example_that_runs():
    """Issue 59 item 6: every public name shows its use, in its docstring or in a runnable
    ```python block of the guide that the reference page links to (both run in CI)."""
    gen = _generator()
    gen._source_path()
    import importlib

    modules = [importlib.import_module(m) for m in gen.MODULES]
    names = [(f"{m.__name__}.{n}", getattr(m, n)) for m in modules for n in m.__all__]
    uses = gen.guide_uses([q for q, _ in names])
    missing = [q for q, obj in names if not _has_example(obj) and q not in uses]
    assert not missing, f"public names with no example in their docstring or the guide: {missing}"
