"""Shared test set-up.

MindSpore must be imported before Paddle in one process (Paddle's oneDNN, loaded
first, lacks a symbol MindSpore's CPU kernels need), so it is imported here first
when installed.
"""

import importlib.util
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Without an NVIDIA GPU the Triton kernels run in Triton's CPU interpreter. Triton reads
# this when it decorates a kernel, and MindSpore imports triton (below), so set it first.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

if importlib.util.find_spec("mindspore") is not None:
    import mindspore  # noqa: F401


@pytest.fixture
def pool():
    """A private 256 MiB memory pool, the global one again afterwards."""
    from atbcore.memory import MemoryPool, MemoryPoolConfig, set_memory_pool

    p = MemoryPool(MemoryPoolConfig(max_size=1 << 28))
    prev = set_memory_pool(p)
    yield p
    set_memory_pool(prev)
