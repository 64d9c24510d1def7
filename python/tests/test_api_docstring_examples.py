"""The ``>>>`` examples in the docstrings of ``remat``'s planning, resharding, argument and
error modules run as written, in a directory holding what they name: ``step.json`` (an
8-layer chain's training step, 1 MiB activations) and ``ckpt`` (a one-file Hugging Face
checkpoint of two tensors)."""

from __future__ import annotations

import doctest

import pytest

import remat
from remat import _arguments, _plan, _reshard, errors
from remat_test_graphs import write_chain


@pytest.fixture()
def example_dir(tmp_path, monkeypatch):
    np = pytest.importorskip("numpy")
    st = pytest.importorskip("safetensors.numpy")
    write_chain(tmp_path / "step.json")
    (tmp_path / "ckpt").mkdir()
    st.save_file({"w": np.arange(24, dtype=np.float32).reshape(6, 4),
                  "b": np.ones(3, dtype=np.float16)},
                 str(tmp_path / "ckpt" / "model.safetensors"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("module", [_plan, _reshard, _arguments, errors],
                         ids=lambda m: m.__name__)
def test_docstring_examples_run_as_written(example_dir, module):
    result = doctest.testmod(module, extraglobs={"remat": remat},
                             optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                             verbose=False, report=True)
    assert result.attempted > 0, f"{module.__name__}: no docstring examples"
    assert result.failed == 0, f"{module.__name__}: {result.failed} examples failed"
