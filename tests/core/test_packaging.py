"""The distribution's metadata: PEP 639 license, the LICENSE text, PEP 561 markers in
every package, the ``atb`` package found by setuptools, classifiers."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["atb", "atbcore", "atb_torch", "atb_mindspore", "atb_paddle", "atb_plugins"]


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_is_a_pep639_expression_with_the_apache_text():
    proj = _project()["project"]
    assert proj["license"] == "Apache-2.0" and proj["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) == 202
    assert not any(c.startswith("License ::") for c in proj["classifiers"])  # PEP 639: not both


def test_every_package_is_found_and_typed():
    from setuptools import find_packages

    cfg = _project()["tool"]["setuptools"]
    found = {p: where for where in cfg["packages"]["find"]["where"]
             for p in find_packages(str(ROOT / where), include=cfg["packages"]["find"]["include"])}
    for pkg in PACKAGES:
        assert pkg in found, pkg
        assert (ROOT / found[pkg] / pkg / "py.typed").is_file(), pkg
    assert cfg["package-data"]["*"] == ["py.typed"]
    assert "Typing :: Typed" in _project()["project"]["classifiers"]


def test_console_script_and_python_m_entry_are_the_same_main():
    assert _project()["project"]["scripts"]["atb"] == "atbcore.cli.main:main"
    main_py = (ROOT / "adapters" / "torch" / "atb" / "__main__.py").read_text()
    assert "from atbcore.cli.main import main" in main_py
