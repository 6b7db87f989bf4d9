"""One torch thread for these tests: the models are tiny, and on a shared 2-core
machine two spinning OpenMP threads per process slow every small op down."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
