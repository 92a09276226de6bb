"""Packaging metadata: the version in one place, the license as SPDX, the citation and changelog agreeing with it."""

from pathlib import Path

import pytest
import yaml

import rank_lightning

tomllib = pytest.importorskip("tomllib")  # the standard library's TOML reader, Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def test_the_version_lives_in_the_package_only_and_the_citation_and_changelog_follow_it():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "rank_lightning.__version__"}
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert citation["version"] == rank_lightning.__version__
    assert f"\n## [{rank_lightning.__version__}]\n" in (ROOT / "CHANGELOG.md").read_text()


def test_license_is_an_spdx_expression_with_its_file_and_the_package_is_typed():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert (ROOT / "rank_lightning" / "py.typed").is_file()


def test_citation_cites_the_four_papers():
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    first_authors = [reference["authors"][0]["family-names"] for reference in citation["references"]]
    assert first_authors == ["Feng", "Zangrando", "Sanyal", "Daneshmand"]
    assert all(reference["identifiers"][0]["value"].startswith("arXiv:") for reference in citation["references"])


def test_the_minimum_constraints_pin_every_declared_lower_bound():
    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]
    lines = (ROOT / "constraints" / "minimum.txt").read_text().splitlines()
    pinned = {r.name: r for r in (Requirement(line) for line in lines if line.strip() and not line.startswith("#"))}
    unpinned = {"torch", "torchvision", "deepspeed", "ruff", "weightwatcher"}  # see constraints/minimum.txt
    assert {r.name for r in declared} - unpinned == set(pinned)
    for requirement in declared:
        if requirement.name in unpinned:
            continue
        (bound,) = [s.version for s in requirement.specifier if s.operator == ">="]
        (pin,) = [s.version for s in pinned[requirement.name].specifier if s.operator == "=="]
        assert Version(pin) == Version(bound), requirement.name
        assert pinned[requirement.name].extras == requirement.extras, requirement.name
