"""Fixtures every test file shares."""

import pytest

try:
    import torch
except ImportError:  # the planner and resharder tests run without PyTorch
    torch = None


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread per test: bit-identical comparisons need a fixed thread count, and
    the CI machine has two cores."""
    if torch is None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
