"""`atb` start-up: `--help`/`--version` load no heavy module, `python -m atb` is the same
command, bad input is one line and exit status 2 before torch is imported, and the CLI
works where torch cannot be imported."""

import os
import subprocess
import sys
import textwrap

import pytest

import atbcore
from atbcore.cli.main import COMMANDS

HEAVY = ("numpy", "ml_dtypes", "rich", "torch", "transformers")

# A sys.meta_path finder that makes `import torch` fail, as on a machine without torch.
BLOCK_TORCH = textwrap.dedent("""
    import sys
    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"No module named {name!r} (blocked by the test)")
            return None
    sys.meta_path.insert(0, _NoTorch())
""")


def _py(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)


def _cli_then_modules(argv: list[str], prelude: str = "") -> subprocess.CompletedProcess:
    """Run the CLI in a fresh interpreter, then print which heavy modules it imported."""
    code = prelude + textwrap.dedent(f"""
        import sys
        from atbcore.cli.main import main
        try:
            rc = main({argv!r})
        except SystemExit as e:
            rc = e.code
        print("RC", rc)
        print("LOADED", sorted(m for m in {HEAVY!r} if m in sys.modules))
    """)
    return _py(code)


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_import_nothing_heavy(flag):
    r = _cli_then_modules([flag])
    assert "RC 0" in r.stdout, r.stderr
    assert "LOADED []" in r.stdout
    if flag == "--version":
        assert r.stdout.splitlines()[0] == f"atb {atbcore.__version__}"
    else:
        for name in ("info", "ops", "bench", "generate", "plugins"):
            assert name in r.stdout


def test_python_m_atb_is_the_cli():
    r = subprocess.run([sys.executable, "-m", "atb", "--version"], capture_output=True,
                       text=True)
    assert (r.returncode, r.stdout.strip()) == (0, f"atb {atbcore.__version__}")
    r = subprocess.run([sys.executable, "-m", "atb", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "usage: atb" in r.stdout and "generate" in r.stdout


def test_a_command_that_is_not_shipped_is_an_argparse_error():
    assert "verify" in COMMANDS  # named in the design, its module may be absent
    r = _cli_then_modules(["no-such-command"])
    assert "RC 2" in r.stdout and "invalid choice" in r.stderr


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "/nonexistent/atb-model"], "/nonexistent/atb-model: no such folder"),
    (["generate", "--model", __file__], "not a folder"),
    (["generate", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, given 0"),
    (["generate", "--top-p", "1.5"], "--top-p must be in (0, 1], given 1.5"),
    (["generate", "--device", "tpu"], "--device: expected cpu, cuda[:i] or npu[:i], given 'tpu'"),
])
def test_generate_checks_its_input_before_importing_torch(argv, message):
    r = _cli_then_modules(argv)
    assert "RC 2" in r.stdout
    assert "LOADED []" in r.stdout  # the answer came before torch, NumPy or rich loaded
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("atb generate: ") and message in lines[0]


def test_bench_checks_its_input_before_importing_anything_heavy():
    r = _cli_then_modules(["bench", "--model", "/nonexistent/atb-model"])
    assert "RC 2" in r.stdout and "LOADED []" in r.stdout
    assert r.stderr.strip() == ("atb bench: --model /nonexistent/atb-model: not a local "
                                "directory (hub names are not fetched)")


def test_generate_without_config_json_is_refused_up_front(tmp_path):
    r = _cli_then_modules(["generate", "--model", str(tmp_path)])
    assert "RC 2" in r.stdout and "LOADED []" in r.stdout
    assert r.stderr.strip() == f"atb generate: --model {tmp_path}: no config.json in this folder"


def _unavailable_devices() -> list[str]:
    import torch

    from atb_torch.devices import torch_npu_importable

    devs = [] if torch.cuda.is_available() else ["cuda", "cuda:1"]
    return devs + ([] if torch_npu_importable() else ["npu"])


@pytest.mark.parametrize("device", _unavailable_devices())
def test_generate_on_an_unavailable_device_is_one_line(device):
    r = subprocess.run([sys.executable, "-m", "atb", "generate", "--device", device],
                       capture_output=True, text=True)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("atb generate: --device: ") and device in lines[0]


def test_cli_works_without_torch(tmp_path):
    r = _cli_then_modules(["--version"], prelude=BLOCK_TORCH)
    assert "RC 0" in r.stdout and f"atb {atbcore.__version__}" in r.stdout
    # the real `python -m atb`, torch blocked from interpreter start (sitecustomize)
    (tmp_path / "sitecustomize.py").write_text(BLOCK_TORCH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
    for args, want in ((["--version"], f"atb {atbcore.__version__}"), (["--help"], "usage: atb")):
        r = subprocess.run([sys.executable, "-m", "atb", *args], capture_output=True, text=True,
                           env=env)
        assert r.returncode == 0 and r.stdout.startswith(want), r.stderr
    r = subprocess.run([sys.executable, "-c", "import atb"], capture_output=True, text=True,
                       env=env)
    assert r.returncode == 1 and "blocked by the test" in r.stderr  # the blocker is active
