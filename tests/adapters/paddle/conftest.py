"""Paddle test fixtures."""

import pytest


@pytest.fixture(params=["native", "framework"])
def kernel_path(request):
    """Run the test with atb's C kernels on Paddle tensors ("native") and, with them
    turned off, with Paddle's own kernels ("framework"): both paths are checked."""
    from atbcore.backends.cpu_kernels.native_kernels import native_off

    if request.param == "framework":
        with native_off():
            yield request.param
    else:
        yield request.param
