"""The unit tier follows from how a test is built (tests/_tiers.py) and cannot lie: a test that
reaches the process harness is not unit, ranks as threads are, and a unit test that starts a
process anyway fails, naming itself."""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

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
