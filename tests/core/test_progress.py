"""atbcore.progress: a spinner on terminals for long work, nothing elsewhere."""

import io
import sys

from rich.console import Console

from atbcore.progress import progress


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=terminal, width=80), buf


def test_on_a_terminal_the_spinner_names_the_work_and_the_block_runs(monkeypatch):
    monkeypatch.delenv("ATB_PROGRESS", raising=False)
    con, buf = _console(True)
    ran = []
    with progress("building the CPU C kernels", threshold_s=0, console=con):
        ran.append(1)
    assert ran == [1] and "building the CPU C kernels" in buf.getvalue()


def test_short_work_shows_nothing(monkeypatch):
    monkeypatch.delenv("ATB_PROGRESS", raising=False)
    con, buf = _console(True)
    with progress("compiling", threshold_s=3600, console=con):
        pass
    assert buf.getvalue() == ""


def test_not_a_terminal_or_switched_off_shows_nothing(monkeypatch, capsys):
    monkeypatch.delenv("ATB_PROGRESS", raising=False)
    con, buf = _console(False)
    with progress("compiling", threshold_s=0, console=con):
        pass
    assert buf.getvalue() == ""
    with progress("compiling", threshold_s=0):  # the default console: pytest's stderr
        pass
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("ATB_PROGRESS", "0")
    con, buf = _console(True)
    with progress("compiling", threshold_s=0, console=con):
        pass
    assert buf.getvalue() == ""


def test_an_error_in_the_block_propagates_and_stops_the_display(monkeypatch):
    monkeypatch.delenv("ATB_PROGRESS", raising=False)
    con, _ = _console(True)
    stdout = sys.stdout
    try:
        with progress("compiling", threshold_s=0, console=con):
            raise KeyError("x")
    except KeyError:
        pass
    else:
        raise AssertionError("the error was swallowed")
    # the display was stopped: a live display redirects sys.stdout until it stops
    assert sys.stdout is stdout


def test_with_a_total_the_steps_are_counted(monkeypatch):
    monkeypatch.delenv("ATB_PROGRESS", raising=False)
    con, buf = _console(True)
    with progress("preparing weights", threshold_s=0, console=con, total=4) as advance:
        for _ in range(4):
            advance()
    shown = buf.getvalue()
    assert "preparing weights" in shown and "4/4" in shown


def test_enabled_false_silences_and_advance_still_works(monkeypatch):
    monkeypatch.delenv("ATB_PROGRESS", raising=False)
    con, buf = _console(True)
    with progress("compiling", threshold_s=0, console=con, total=2, enabled=False) as advance:
        advance()
        advance(1)
    assert buf.getvalue() == ""
    monkeypatch.setenv("ATB_PROGRESS", "0")  # the environment's off switch wins over True
    with progress("compiling", threshold_s=0, console=con, enabled=True):
        pass
    assert buf.getvalue() == ""


def test_enabled_true_shows_on_a_stream_that_is_not_a_terminal(monkeypatch):
    monkeypatch.delenv("ATB_PROGRESS", raising=False)
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    with progress("compiling", threshold_s=0, total=1, enabled=True) as advance:
        advance()
    assert "compiling" in buf.getvalue() and "1/1" in buf.getvalue()
