"""pyproject.toml's dependency ranges, check_compatibility's table and CI's exact
versions agree: one range per package, and every version CI installs lies in it."""

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from atbcore.runtime import config

ROOT = Path(__file__).resolve().parents[3]


def _declared() -> dict[str, SpecifierSet]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out: dict[str, SpecifierSet] = {}
    for req in project["dependencies"] + sum(project["optional-dependencies"].values(), []):
        r = Requirement(req)
        if r.name in config.SUPPORTED and r.name != "atb":
            assert out.setdefault(r.name, r.specifier) == r.specifier, f"two ranges for {r.name}"
    return out


def _pins(name: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / ".ci" / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            r = Requirement(line)
            pins[r.name] = str(r.specifier).removeprefix("==")
    return pins


def test_pyproject_ranges_are_check_compatibilitys():
    declared = _declared()
    assert {"torch", "transformers", "sentence-transformers"} <= set(declared)
    for name, spec in declared.items():
        lowest, beyond = config.SUPPORTED[name]
        want = SpecifierSet(f">={lowest}" + (f",<{beyond}" if beyond else ""))
        assert spec == want, f"{name}: pyproject {spec}, check_compatibility {want}"


@pytest.mark.parametrize("constraints", ["constraints.txt", "constraints-oldest.txt"])
def test_ci_versions_inside_the_ranges(constraints):
    declared = _declared()
    pins = _pins(constraints)
    assert "torch" in pins and "transformers" in pins  # exact: CPU torch, known HF
    for name, version in pins.items():
        if name in declared:
            assert version in declared[name], f"{constraints}: {name}=={version} vs {declared[name]}"
    if constraints == "constraints-oldest.txt":  # the oldest really is the range's bottom
        assert pins["transformers"].startswith(config.SUPPORTED["transformers"][0])


@pytest.mark.parametrize("version,problem", [("4.57.1", "older than the supported minimum 5.0"),
                                             ("6.0.0", "newer than the supported range (< 6)"),
                                             ("5.24.0", None)])
def test_check_compatibility_flags_transformers_outside_the_range(monkeypatch, version, problem):
    real = config.package_version
    monkeypatch.setattr(config, "package_version",
                        lambda name: version if name == "transformers" else real(name))
    rep = config.check_compatibility()
    found = [p for p in rep["problems"] if p.startswith("transformers")]
    assert found == ([] if problem is None else [f"transformers {version} is {problem}"])
