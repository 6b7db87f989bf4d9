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
