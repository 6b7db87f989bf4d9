"""The Triton kernels run on CUDA tensors when a GPU is present, else on CPU tensors in
Triton's interpreter (``TRITON_INTERPRET=1``, set by ``tests/conftest.py`` before
anything imports triton: Triton reads it when it decorates a kernel)."""

import pytest


@pytest.fixture(scope="session")
def device():
    """Where the kernels' tensors live: "cpu" under the interpreter, else "cuda"."""
    import torch

    from atbcore.backends.triton import interpreting

    if interpreting():
        return "cpu"
    if not torch.cuda.is_available():
        pytest.fail("no CUDA GPU and TRITON_INTERPRET is not set: set TRITON_INTERPRET=1 "
                    "before triton is imported (tests/conftest.py does without /dev/nvidiactl)")
    return "cuda"
