"""One import name: pyproject.toml's package map, pdserve/__init__.py's checkout map and the tree agree,
and from the repository root Hugging Face's ``kernels`` (a dependency of transformers) is not shadowed."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

import pdserve
from tests.cluster import ROOT

SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _python_folders(folder) -> list:
    """``folder`` and every folder below it that holds Python code (no caches)."""
    return sorted(
        d
        for d in [folder, *folder.rglob("*")]
        if d.is_dir() and "__pycache__" not in d.parts and any(d.glob("*.py"))
    )


def test_the_wheel_maps_exactly_the_folders_the_checkout_maps():
    expected = {"pdserve": "pdserve"} | {f"pdserve.{name}": name for name in pdserve.SUBPACKAGES}
    assert SETUPTOOLS["package-dir"] == expected


def test_the_wheel_lists_every_folder_of_python_code():
    listed = set(SETUPTOOLS["packages"])
    folders = set()
    for package, folder in SETUPTOOLS["package-dir"].items():
        for d in _python_folders(ROOT / folder):
            folders.add(".".join([package, *d.relative_to(ROOT / folder).parts]))
    assert listed == folders, f"missing: {sorted(folders - listed)}, extra: {sorted(listed - folders)}"


def test_the_kernels_sources_are_package_data():
    patterns = SETUPTOOLS["package-data"]["pdserve.kernels"]
    sources = {p.name for p in (ROOT / "kernels" / "csrc").iterdir()}
    covered = {p.name for pattern in patterns for p in (ROOT / "kernels").glob(pattern)}
    assert sources and sources == covered


def test_only_pdserve_is_a_top_level_name_of_the_wheel():
    assert {package.split(".")[0] for package in SETUPTOOLS["packages"]} == {"pdserve"}
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"] == {
        "pdserve": "pdserve.cli.main:main"
    }


@pytest.mark.usefixtures("processes")
def test_from_the_repository_root_a_bare_kernels_import_is_not_this_projects():
    # kernels/ has no __init__.py: with the root on sys.path a regular package of that name
    # (Hugging Face's, which transformers 5.25+ imports) wins over the folder.
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "import pdserve.kernels.ops as ops\n"
        "print(spec is None or spec.origin is None or 'site-packages' in spec.origin, ops.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "pdserve.kernels.ops"]


@pytest.mark.usefixtures("processes")
def test_transformers_imports_its_kernels_integration_from_the_repository_root():
    pytest.importorskip("kernels", reason="Hugging Face's kernels package is not installed")
    code = "import transformers.integrations.hub_kernels as h, kernels; print(kernels.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "site-packages" in out.stdout


def test_the_package_root_offers_the_engines_names_lazily():
    import pdserve.engine

    assert set(pdserve.__all__) == set(pdserve.engine.__all__)
    assert pdserve.LLM is pdserve.engine.LLM and pdserve.SamplingParams is pdserve.engine.SamplingParams
