"""The unit tier follows from how a test is built (tests/_tiers.py) and cannot lie: a test that
reaches the process harness is not unit, ranks as threads are, and a unit test that starts a
process anyway fails, naming itself."""
from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import sys
import threading

import pytest

from _harness import run_ranks
from _threads import run_threads
from _tiers import Guard, Reader


def _threads_only():
    return run_threads(lambda pg, r: r, 2)


def _through_a_helper():
    return _helper()


def _helper():
    return run_ranks(_rank, 2)


def _rank(rank, P, lr):
    return rank


def _imports_inside():
    import subprocess as sp
    return sp


def _os_call():
    return os.system("true")


class _Holder:
    @staticmethod
    def go():
        return multiprocessing.get_context("spawn")


def test_the_reader_follows_names_helpers_imports_and_classes():
    reader = Reader()
    assert reader.reaches(_threads_only) is None
    assert reader.reaches(lambda: sys.platform) is None
    found = reader.reaches(_through_a_helper)
    assert found.startswith("_through_a_helper -> _helper -> run_ranks"), found
    assert found.endswith("multiprocessing"), found
    assert reader.reaches(_imports_inside) == "_imports_inside -> import subprocess"
    assert reader.reaches(_os_call) == "_os_call -> os.system"
    assert reader.reaches(_Holder.go) is not None
    assert reader.reaches(_Holder) is not None
    assert reader.reaches(_threads_only) is None  # what was read clean stays clean


def test_the_matrix_on_threads_is_unit_and_its_process_subset_is_not():
    import test_backend_collectives as m
    reader = Reader()
    for name in ("test_collectives_match_gloo", "test_collectives_match_gloo_16_ranks",
                 "test_all_reduce_halving_doubling", "test_synchronous_calls_run_in_the_callers_"
                 "thread_in_order"):
        assert reader.reaches(getattr(m, name)) is None, name
    assert "run_ranks" in reader.reaches(m.test_collectives_match_gloo_between_processes)


def test_a_unit_test_that_starts_a_process_fails_naming_itself():
    guard, real = Guard(), subprocess.Popen._execute_child
    guard.install()
    guard.nodeid = "tests/test_x.py::test_y"
    try:
        for start in (lambda: subprocess.run(["true"]),
                      lambda: multiprocessing.get_context("fork").Process(target=print).start(),
                      lambda: os.system("true")):
            with pytest.raises(pytest.fail.Exception, match=r"^tests/test_x.py::test_y started a "
                                                           r"process .* it is not unit-tier"):
                start()
        assert len(guard.started) == 3
        guard.nodeid = None  # outside a unit test, processes start as usual
        assert subprocess.run(["true"]).returncode == 0
    finally:
        guard.uninstall()
        guard.nodeid = None
    assert subprocess.Popen._execute_child is real
    assert os.system("true") == 0


def test_a_process_started_by_an_earlier_tests_thread_is_not_blamed_on_this_one():
    """A thread alive before the test began (a process-tier test's helper winding down) may
    start a process meanwhile: the unit test running then did not; a thread the test starts
    is the test's own."""
    go, done, out = threading.Event(), threading.Event(), []

    def leftover():
        go.wait(10)
        out.append(subprocess.run(["true"]).returncode)
        done.set()

    t = threading.Thread(target=leftover, daemon=True)
    t.start()
    guard = Guard()
    guard.install()
    guard.nodeid = "tests/test_x.py::test_y"
    try:
        go.set()
        assert done.wait(10) and out == [0]

        def own():
            try:
                subprocess.run(["true"])
            except pytest.fail.Exception as e:
                out.append(str(e))

        mine = threading.Thread(target=own, name="own-thread")
        mine.start()
        mine.join(10)
        # what was started, from where (the frame that called subprocess), and in which thread
        assert re.search(r"started a process \(subprocess\.Popen `true` from \S*test_tiers\.py:\d+, "
                         r"in thread own-thread\)", out[1]), out
    finally:
        guard.uninstall()
        guard.nodeid = None
    t.join(10)


_LAST = '''
import subprocess, pytest

@pytest.fixture(scope="session")
def lab():
    yield 1
    subprocess.run(["true"])  # as netlab.down: ip netns del

def test_with_the_lab(lab):
    assert lab == 1

def test_unit_and_last():
    assert True
'''


@pytest.mark.timeout(120)
def test_the_last_tests_teardown_may_end_session_fixtures_that_start_processes(tmp_path):
    """A worker's last test tears the session's fixtures down in its own teardown (a netlab
    lab used by other tests): the unit test that happens to run last is not blamed for
    them (it was, with an error at teardown, in a fresh-clone run)."""
    (tmp_path / "test_last.py").write_text(_LAST)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-p", "conftest", "--rootdir", str(tmp_path), "test_last.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert p.returncode == 0 and "2 passed" in p.stdout, p.stdout + p.stderr
