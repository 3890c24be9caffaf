"""The suite's tiers: a test that starts a process carries the ``processes`` marker, given by the
fixture of that name (tests/conftest.py), and one that does not, fails."""

from __future__ import annotations

import re

import pytest

from tests.cluster import ROOT

pytest_plugins = ["pytester"]

SAMPLE = """
import subprocess, sys
import multiprocessing
import pytest

def test_unmarked_runs_a_child():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_unmarked_starts_a_multiprocessing_child():
    child = multiprocessing.get_context("spawn").Process(target=print)
    child.start()
    child.join()

@pytest.mark.usefixtures("processes")
def test_marked_runs_a_child():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

@pytest.fixture
def child(processes):
    return subprocess.run([sys.executable, "-c", "print(7)"], capture_output=True, text=True).stdout

def test_marked_through_a_fixture(child):
    assert child.strip() == "7"

def test_unmarked_computes():
    assert sum(range(4)) == 6
"""


@pytest.mark.usefixtures("processes")
def test_a_test_that_starts_a_process_without_the_fixture_fails_and_the_tiers_split_by_it(pytester):
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile(test_sample=SAMPLE)
    everything = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    everything.assert_outcomes(passed=3, failed=2)
    assert everything.stdout.str().count("without the `processes` fixture") >= 2
    assert "(Popen.__init__)" in everything.stdout.str() and "(BaseProcess.start)" in everything.stdout.str()
    fast = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "-m", "not processes")
    fast.assert_outcomes(passed=1, failed=2, deselected=2)


def test_the_tests_make_their_http_calls_through_tests_web():
    """httpx.get/post/stream build an SSL context per call (tests/web.py says what that cost): every
    test module calls them through tests/web.py, which builds one."""
    call = re.compile(r"\bhttpx\.(get|post|stream)\(")
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if path.name != "web.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if call.search(line)
    ]
    assert offenders == [], f"call tests/web.py's get/post/stream instead: {offenders}"
