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

Every skip of a run is listed at its end with its reason (under pytest-xdist: by the controller,
from the workers' reports). A reason that ALLOWED_SKIPS does not accept (what this machine
cannot have: RDMA hardware, a GPU, root and network namespaces ...) is printed as unexpected
and fails the run: a tool or package the suite needs is missing (tools/quickstart.sh installs
them), or a new skip hides a check that could run.

The fake peer of the transport tests and the fuzzer is ``linerate.transport.fakepeer.FakePeer``.
"""
from __future__ import annotations

import os
import re
import sys
import uuid

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _harness, for every file

from _harness import netlab_reason, use_transport  # noqa: E402


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # not a pytest-xdist worker
        config.pluginmanager.register(SkipLedger(), "linerate-skip-ledger")
    config.addinivalue_line("markers", "netlab: needs netlab (root, iproute2); skipped with the "
                                       "reason where it cannot work")
    config.addinivalue_line("markers", "slow: takes a minute or so (tests/test_packaging.py's "
                                       "wheel); -m 'not slow' leaves it out")
    config.addinivalue_line("markers", "unit: in this process, no rank processes started "
                                       "(ranks as threads: tests/_threads.py); `-m unit` is the "
                                       "fast tier")


#: Files whose tests run in this process, ranks (if any) as threads: the ``unit`` tier.
UNIT_FILES = {"test_unit_backend.py", "test_matching.py", "test_model.py", "test_whatif.py",
              "test_fuzz.py", "test_dashboard.py", "test_settings.py", "test_slowlink.py",
              "test_staging.py", "test_resizable.py"}
#: Single tests of other files that start no rank process.
UNIT_TESTS = {"test_docs.py": ("test_every_directive_is_understood",
                               "test_settings_page_is_generated_from_the_registry",
                               "test_readme_settings_rows_agree_with_the_registry",
                               "test_readme_is_a_guide",
                               "test_no_file_speaks_of_numbered_working_periods",
                               "test_docs_site_builds_strictly",
                               "test_api_reference_names_every_public_name",
                               "test_settings_page_capitalises_no_name",
                               "test_faults_page_lists_every_setting_ranks_must_share"),
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
                                      "test_every_section_of_the_page_names_its_machine_and_command",
                                      "test_a_plot_is_written_by_its_command_and_shown_under_its_table",
                                      "test_every_picture_of_the_page_exists_and_comes_from_its_sections_command")}


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


# ----------------------------------------------------------------------------- skips
#: (what is absent, pattern of the skip reasons it causes): the skips a run may show, for what
#: the machine cannot have, and for the optional extra and container engine that the test
#: command (tools/quickstart.sh) does not install. A tool it installs is not one of them.
ALLOWED_SKIPS = (
    ("RDMA hardware", r"^no RDMA device: |^this machine has an RDMA device"),
    ("GPU", r"\b(CUDA|GPU)\b"),  # none here, or one here where a check needs none
    ("root and network namespaces",
     r"^netlab unavailable: (netlab needs Linux|netlab needs root|netlab cannot create)"),
    ("kernel or CPU feature", r"^this kernel's |^no futex system call number for this machine"),
    ("pyverbs for this platform or Python",
     r"^this platform's packages have no python3-pyverbs|"
     r"^the system's pyverbs cannot load in this Python: .*built for"),
    ("Python >= 3.11", r"needs Python >= 3\.11$"),
    ("container engine", r"^no compose CLI "),
    ("optional extra 'frameworks'",
     r"^optional extra 'frameworks' not installed: |is not installed \(pip install '\.\[frameworks\]'"),
)


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = str(longrepr[2]) if isinstance(longrepr, (tuple, list)) and len(longrepr) == 3 \
        else str(longrepr)
    return reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason


def skip_category(reason: str) -> str | None:
    """The absence of ALLOWED_SKIPS that ``reason`` names, or None: an unexpected skip."""
    for what, pattern in ALLOWED_SKIPS:
        if re.search(pattern, reason):
            return what
    return None


class SkipLedger:
    """Every skip of the run, listed at its end; an unexpected one fails the run. Registered
    where the run is reported (under pytest-xdist the controller, which gets every worker's
    reports), never in a worker."""

    def __init__(self):
        self.skips: list[tuple[str, str]] = []  # (node id, reason)

    def _note(self, report) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skips.append((report.nodeid, _skip_reason(report)))

    def pytest_runtest_logreport(self, report):
        self._note(report)

    def pytest_collectreport(self, report):
        self._note(report)

    def unexpected(self) -> list[tuple[str, str]]:
        return [(node, why) for node, why in self.skips if skip_category(why) is None]

    def pytest_sessionfinish(self, session):
        if self.unexpected() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if not self.skips:
            return
        tr, bad = terminalreporter, self.unexpected()
        tr.write_sep("=", f"skips: {len(self.skips)}" + (f", {len(bad)} unexpected" if bad else ""),
                     red=bool(bad), yellow=not bad)
        by_reason: dict[str, list[str]] = {}
        for node, why in self.skips:
            by_reason.setdefault(why, []).append(node)
        for why, nodes in sorted(by_reason.items(), key=lambda kv: skip_category(kv[0]) is not None):
            what = skip_category(why)
            if what is None:
                tr.write_line(f"UNEXPECTED ({len(nodes)}): {why}", red=True, bold=True)
                for node in nodes:
                    tr.write_line(f"    {node}")
            else:
                tr.write_line(f"allowed, no {what} ({len(nodes)}): {why}")
        if bad:
            tr.write_line("The run fails on the unexpected skips above: each hides a check this "
                          "machine could run. Install what it names (tools/quickstart.sh installs "
                          "the suite's tools), or, if no machine like this one can have it, add "
                          "the absence to ALLOWED_SKIPS in tests/conftest.py.", red=True, bold=True)


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
