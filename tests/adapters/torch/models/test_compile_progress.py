"""``compile()``'s progress display: the layers' weights counted on a terminal,
nothing when stderr is not one, when ``ATB_PROGRESS=0`` or ``progress=False``; the
compiled model's answers are unchanged either way."""

import io
import sys

import pytest
import torch

from atb_torch.models import compile as atb_compile
from atbcore.numerics import assert_close

from tiny_models import tiny

# the module (the package re-exports its function under the same name)
compile_module = sys.modules["atb_torch.models.compile"]


class _Stream(io.StringIO):
    """A stderr stand-in that says whether it is a terminal."""

    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.fixture
def stderr(monkeypatch):
    """Install a fake stderr (``stderr(tty)``) with the display shown at once."""
    monkeypatch.delenv("ATB_PROGRESS", raising=False)
    monkeypatch.setattr(compile_module, "PROGRESS_AFTER_S", 0)
    for name in ("TERM", "NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)

    def install(tty: bool) -> _Stream:
        stream = _Stream(tty)
        monkeypatch.setattr(sys, "stderr", stream)
        return stream
    return install


def _layers_line(n: int) -> str:
    return f"{n}/{n}"


def test_on_a_terminal_the_layers_are_counted(stderr):
    m = tiny("llama", num_hidden_layers=3)
    err = stderr(True)
    fast = atb_compile(m)
    shown = err.getvalue()
    assert "atb: compiling LlamaForCausalLM" in shown
    assert _layers_line(3) in shown and "0/3" in shown
    ids = torch.tensor([[5, 9, 31, 7]])
    with torch.no_grad():
        assert_close(fast(ids).logits, m(ids).logits, "fp32", "compiled with the display")


@pytest.mark.parametrize("case", ["not a terminal", "ATB_PROGRESS=0", "progress=False"])
def test_silent_off_a_terminal_or_when_switched_off(stderr, monkeypatch, case):
    m = tiny("llama")
    err = stderr(case != "not a terminal")
    if case == "ATB_PROGRESS=0":
        monkeypatch.setenv("ATB_PROGRESS", "0")
    atb_compile(m, progress=False if case == "progress=False" else None)
    assert err.getvalue() == ""


def test_progress_true_shows_it_on_any_stream(stderr):
    err = stderr(False)
    atb_compile(tiny("qwen2"), progress=True)
    assert "atb: compiling Qwen2ForCausalLM" in err.getvalue()
    assert _layers_line(2) in err.getvalue()


def test_fast_compiles_show_nothing_by_default(monkeypatch):
    """The display waits PROGRESS_AFTER_S: a tiny model compiles before it."""
    monkeypatch.delenv("ATB_PROGRESS", raising=False)
    monkeypatch.setattr(compile_module, "PROGRESS_AFTER_S", 3600)
    err = _Stream(True)
    monkeypatch.setattr(sys, "stderr", err)
    atb_compile(tiny("llama"))
    assert err.getvalue() == ""
