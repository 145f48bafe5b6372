"""Fixtures and markers shared by the test files (their plain helpers are in tests/_harness.py).

- ``@pytest.mark.netlab``: the test needs netlab (root, iproute2, network namespaces); it is
  skipped with the reason where netlab cannot work.
- ``transport``: runs a transport test once per transport, ``tcp``; ``rdma-fake`` (the RDMA
  transport on the fake pyverbs of tests/fake_pyverbs); ``rdma`` (this machine's real RDMA
  device, skipped with the reason where there is none).
- ``lab_name``: a netlab lab name unique to the test, torn down afterwards whatever happened.
- ``lab_4x2``: one netlab lab of 4 hosts x 2 rails at 200 Mbit/s, built once per test process
  for the tests that run ranks on such a cluster (tests/test_slowlink.py, test_straggler.py)
  and torn down at the end; a test that reshapes a link puts it back.

The fake peer of the transport tests and the fuzzer is ``linerate.transport.fakepeer.FakePeer``.
"""
from __future__ import annotations

import os
import sys
import uuid

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _harness, for every file

from _harness import netlab_reason, use_transport  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "netlab: needs netlab (root, iproute2); skipped with the "
                                       "reason where it cannot work")
    config.addinivalue_line("markers", "slow: takes a minute or so (tests/test_packaging.py's "
                                       "wheel); -m 'not slow' leaves it out")
    config.addinivalue_line("markers", "unit: in this process, no rank processes started "
                                       "(ranks as threads: tests/_threads.py); `-m unit` is the "
                                       "fast tier")


#: Files whose tests run in this process, ranks (if any) as threads: the ``unit`` tier.
UNIT_FILES = {"test_unit_backend.py", "test_matching.py", "test_model.py", "test_whatif.py",
              "test_fuzz.py", "test_dashboard.py", "test_settings.py", "test_slowlink.py"}
#: Single tests of other files that start no rank process.
UNIT_TESTS = {"test_docs.py": ("test_every_directive_is_understood",
                               "test_settings_page_is_generated_from_the_registry",
                               "test_readme_settings_rows_agree_with_the_registry",
                               "test_readme_is_a_guide",
                               "test_no_file_speaks_of_numbered_working_periods",
                               "test_docs_site_builds_strictly"),
              "test_straggler.py": ("test_a_late_rank_is_named_by_its_waiting_peers",
                                    "test_only_the_successor_waits_in_a_ring",
                                    "test_finishing_first_is_not_entering_last",
                                    "test_balanced_and_sparse_views_name_nobody",
                                    "test_views_round_trip_and_junk_is_refused",
                                    "test_the_log_line_names_the_rank_and_link_at_most_once_per_period"),
              "test_shm.py": ("test_usable_cores_follow_the_cgroup_cpu_quota",),
              "test_perf_report.py": ("test_bench_rows_memory_and_link_bounds",
                                      "test_latency_and_fusion_rows",
                                      "test_a_rerun_replaces_its_section_and_keeps_the_others",
                                      "test_every_section_of_the_page_names_its_machine_and_command")}


#: Tests of UNIT_FILES that start processes (a measurement, a child interpreter).
NOT_UNIT = ("test_measure_", "test_pg_options_object_is_used_instead_of_the_environment")


def pytest_collection_modifyitems(config, items):
    for item in items:
        # Under pytest-xdist (tools/quickstart.sh runs two workers): tests that build netlab
        # labs (the docs' examples among them) run one after another on one worker.
        if item.get_closest_marker("netlab") is not None or item.originalname == "test_examples_run":
            item.add_marker(pytest.mark.xdist_group("netlab"))
        name, test = item.path.name, item.originalname
        if ((name in UNIT_FILES and not test.startswith(NOT_UNIT))
                or test in UNIT_TESTS.get(name, ())) and item.get_closest_marker("netlab") is None:
            item.add_marker(pytest.mark.unit)


def pytest_runtest_setup(item):
    if item.get_closest_marker("netlab") is not None:
        reason = netlab_reason()
        if reason is not None:
            pytest.skip(f"netlab unavailable: {reason}")


@pytest.fixture(params=["tcp", "rdma-fake", "rdma"])
def transport(request, monkeypatch):
    from linerate.transport import verbs
    use_transport(request.param, monkeypatch)
    yield request.param
    if request.param != "tcp":
        verbs.reset()


@pytest.fixture
def lab_name():
    """A lab name unique to this test run, torn down afterwards whatever happened."""
    from linerate.tools import netlab
    name = f"t{uuid.uuid4().hex[:8]}"
    try:
        yield name
    finally:
        netlab.down(name)
        assert netlab.lab_netns(name) == []


#: The shared lab of ``lab_4x2``.
LAB_4X2 = dict(hosts=4, rails=2, rate="200mbit")


@pytest.fixture(scope="session")
def lab_4x2():
    """netlab.up(**LAB_4X2) under a name unique to this test process; yields the Lab."""
    from linerate.tools import netlab
    name = f"s{uuid.uuid4().hex[:8]}"
    try:
        yield netlab.up(name, **LAB_4X2)
    finally:
        netlab.down(name)
        assert netlab.lab_netns(name) == []
