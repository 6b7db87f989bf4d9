"""MindSpore test fixtures: run a test body in GRAPH_MODE and restore PyNative."""

import pytest


@pytest.fixture
def graph_mode():
    ms = pytest.importorskip("mindspore", reason="mindspore is not installed")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        yield ms
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


@pytest.fixture(params=["native", "framework"])
def kernel_path(request):
    """Run the test with atb's C kernels on MindSpore tensors ("native") and, with them
    turned off, with the MindSpore compositions ("framework"): both paths are checked."""
    from atbcore.backends.cpu_kernels.native_kernels import native_off

    if request.param == "framework":
        with native_off():
            yield request.param
    else:
        yield request.param
