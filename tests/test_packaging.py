"""One import name, mapped one way: each top-level package folder X/ is ``pdserve.X`` through the
link pdserve/X -> ../X (pdserve/__init__.py says why). The links, pyproject.toml's package list
and a wheel built from the checkout agree with the tree; a resolver that reads only files finds
every subpackage where its folder is; and from the repository root Hugging Face's ``kernels`` (a
dependency of transformers) is not shadowed by ours."""

from __future__ import annotations

import importlib.machinery
import os
import pathlib
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

import pdserve
from tests.cluster import ROOT

SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
PACKAGE_ROOT = ROOT / "pdserve"
# Top-level folders of Python code that are not part of the package: never linked, never shipped.
NOT_SHIPPED = {"tests", "bench", "scripts", "pdserve"}


def linked_folders() -> list[str]:
    """The top-level folders that are subpackages: those pdserve/ links to."""
    return sorted(p.name for p in PACKAGE_ROOT.iterdir() if p.is_symlink())


def _python_folders(folder: pathlib.Path) -> list[pathlib.Path]:
    """``folder`` and every folder below it that holds Python code, through links (no caches)."""
    return sorted(
        pathlib.Path(d)
        for d, _, files in os.walk(folder, followlinks=True)
        if "__pycache__" not in pathlib.Path(d).parts and any(f.endswith(".py") for f in files)
    )


def build_wheel(dest: pathlib.Path) -> pathlib.Path:
    """The wheel ``pip wheel`` builds from a copy of the checkout's files (tracked, or new and not
    ignored; links copied as links): setuptools leaves build/ in the tree it builds, and a stale
    build/lib would slip removed files in."""
    source = dest / "source"
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        path = ROOT / name
        if path.is_symlink() or path.is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, source / name, follow_symlinks=False)
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dest),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = dest.glob("pdserve-*.whl")
    return wheel


def test_every_link_is_relative_and_names_the_top_level_folder_of_its_own_name():
    assert linked_folders(), "pdserve/ links to no folder"
    for name in linked_folders():
        link = PACKAGE_ROOT / name
        # relative: the link keeps working in a copy of the checkout (the image's /src, a clone)
        assert os.readlink(link) == f"../{name}", (name, os.readlink(link))
        assert link.resolve() == (ROOT / name).resolve() and (ROOT / name).is_dir(), name


def test_every_top_level_folder_of_python_code_is_linked_or_named_as_not_shipped():
    folders = {p.parent.name for p in ROOT.glob("*/*.py") if not p.parent.name.startswith(".")}
    folders -= {"build"}  # setuptools' output
    assert folders - NOT_SHIPPED == set(linked_folders())


def test_pyproject_lists_every_folder_of_python_code_under_pdserve_and_maps_none():
    # setuptools' default layout: pdserve.X is the folder pdserve/X, the link; no second map
    assert "package-dir" not in SETUPTOOLS
    listed = set(SETUPTOOLS["packages"])
    folders = {".".join(d.relative_to(ROOT).parts) for d in _python_folders(PACKAGE_ROOT)}
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


@pytest.mark.parametrize("name", linked_folders())
def test_a_resolver_that_reads_only_files_finds_each_subpackage_in_its_folder(name):
    # Python's path finder with the repository root as the only entry, no meta-path hook:
    # what mypy, pyright and an IDE do from the checkout
    top = importlib.machinery.PathFinder.find_spec("pdserve", [str(ROOT)])
    assert top is not None and top.submodule_search_locations is not None
    spec = importlib.machinery.PathFinder.find_spec(f"pdserve.{name}", list(top.submodule_search_locations))
    assert spec is not None and spec.submodule_search_locations is not None, name
    (location,) = spec.submodule_search_locations
    assert pathlib.Path(location).resolve() == (ROOT / name).resolve()


def test_the_package_has_no_import_hook_of_its_own():
    assert not [f for f in sys.meta_path if getattr(f, "__module__", "").startswith("pdserve")]
    assert pathlib.Path(pdserve.__file__).parent == PACKAGE_ROOT  # the checkout's, by its path


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory, processes) -> set[str]:
    return set(zipfile.ZipFile(build_wheel(tmp_path_factory.mktemp("wheel"))).namelist())


def test_the_wheel_holds_every_module_and_kernel_source_as_a_file_under_pdserve(wheel_names):
    expected = {
        f"pdserve/{path.relative_to(ROOT).as_posix()}"
        for name in linked_folders()
        for path in (ROOT / name).rglob("*")
        if path.is_file()
        and "__pycache__" not in path.parts
        and (path.suffix == ".py" or "csrc" in path.parts)
    }
    expected |= {f"pdserve/{p.relative_to(PACKAGE_ROOT).as_posix()}" for p in PACKAGE_ROOT.rglob("*.py")}
    assert any(name.startswith("pdserve/kernels/csrc/") for name in expected)
    missing = expected - wheel_names
    assert not missing, sorted(missing)
    assert {name.split("/")[0] for name in wheel_names if ".dist-info/" not in name} == {"pdserve"}


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
