"""Fixtures and markers shared by the test files (their plain helpers are in tests/_harness.py).

- ``unit``: the fast tier (``pytest -m unit``), set here on every test that starts no
  process, never by hand. Whether a test starts processes follows from how it is built
  (tests/_tiers.py reads it at collection): it does when its code, its fixtures or the helpers
  of tests/ they call reach subprocess, multiprocessing, os.fork/os.system/os.posix_spawn or
  the process harness (tests/_harness.py: run_ranks, run_rank_scripts, run_netlab_script,
  which reach them), or when it is marked ``netlab`` or ``processes``; ranks as threads
  (tests/_threads.py) start none. The claim is checked: while a ``unit`` test runs, starting a
  process fails it, naming it as not unit-tier. ``--tiers`` prints every test's tier and, for
  the others, the chain of calls that starts processes.
- ``@pytest.mark.processes``: the test starts processes where its code does not show it
  (product code that launches them, as tools/linkprobe.py starts iperf3): not unit.
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

import gc
import os
import re
import sys
import uuid

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _harness, for every file

from _harness import netlab_reason, use_transport  # noqa: E402
from _tiers import Guard, Reader, item_starts_processes  # noqa: E402


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # not a pytest-xdist worker
        config.pluginmanager.register(SkipLedger(), "linerate-skip-ledger")
    config.addinivalue_line("markers", "netlab: needs netlab (root, iproute2); skipped with the "
                                       "reason where it cannot work")
    config.addinivalue_line("markers", "slow: takes a minute or so (tests/test_packaging.py's "
                                       "wheel); -m 'not slow' leaves it out")
    config.addinivalue_line("markers", "unit: starts no process (ranks as threads: "
                                       "tests/_threads.py); set from how the test is built "
                                       "(tests/_tiers.py), never by hand; `-m unit` is the fast "
                                       "tier")
    config.addinivalue_line("markers", "processes: starts processes where tests/_tiers.py "
                                       "cannot read it (product code that launches them): not "
                                       "unit")


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    """The test modules' assertion-rewritten code is cached in tests/__pycache__ even where
    PYTHONDONTWRITEBYTECODE is set (pytest writes no cache then): rewriting the ~60 modules
    again costs each pytest process (each xdist worker, each run of ``-m unit``) about 3.5 s
    of its collection's 6. Only while collecting: what runs after keeps the setting."""
    saved, sys.dont_write_bytecode = sys.dont_write_bytecode, False
    try:
        yield
    finally:
        sys.dont_write_bytecode = saved


def pytest_collection_finish(session):
    """What the run has built so far (torch, the test modules: a few hundred thousand objects
    that live as long as the process) leaves the garbage collector's view (``gc.freeze``):
    each full collection then walks only what the tests make. Without it, a test of thread
    ranks spent a sixth of its time in full collections (each holds the interpreter lock,
    stalling every rank's thread)."""
    gc.collect()
    gc.freeze()


def pytest_addoption(parser):
    parser.addoption("--tiers", action="store_true",
                     help="print each collected test's tier, and for the tests that are not "
                          "unit what makes them start processes (tests/_tiers.py)")


def pytest_collection_modifyitems(config, items):
    reader = Reader()
    for item in items:
        # Under pytest-xdist (tools/quickstart.sh runs two workers): tests that build netlab
        # labs run one after another on one worker (the docs' pages with root examples are
        # in that group too: tests/test_docs.py).
        if item.get_closest_marker("netlab") is not None:
            item.add_marker(pytest.mark.xdist_group("netlab"))
        why = item_starts_processes(reader, item)
        if why is None:
            item.add_marker(pytest.mark.unit)
        if config.getoption("--tiers"):
            print(f"{item.nodeid}: " + ("unit" if why is None else f"processes ({why})"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A ``unit`` test that starts a process fails (tests/_tiers.py Guard)."""
    if item.get_closest_marker("unit") is None:
        yield
        return
    _GUARD.nodeid = item.nodeid
    _GUARD.install()
    try:
        yield
    finally:
        _GUARD.uninstall()
        _GUARD.nodeid = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """The last test of a worker also ends the session's fixtures in its teardown (a netlab
    lab: ``ip netns del``): the processes they start are not that test's doing."""
    if nextitem is None and _GUARD.nodeid is not None:
        saved, _GUARD.nodeid = _GUARD.nodeid, None
        try:
            yield
        finally:
            _GUARD.nodeid = saved
    else:
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if _GUARD.started and _GUARD.nodeid == item.nodeid:
        report = outcome.get_result()
        if not report.failed:  # the test swallowed the refusal: it fails all the same
            report.outcome, report.longrepr = "failed", "\n".join(_GUARD.started)
        _GUARD.started.clear()


_GUARD = Guard()


def pytest_runtest_setup(item):
    if item.get_closest_marker("netlab") is not None:
        reason = netlab_reason()
        if reason is not None:
            pytest.skip(f"netlab unavailable: {reason}")


# ----------------------------------------------------------------------------- skips
#: (what is absent, pattern of the skip reasons it causes): the skips a run may show, for what
#: the machine cannot have. A tool or package that the test command (tools/quickstart.sh)
#: installs is not one of them: the frameworks extra, docker-compose, Prometheus, tcpdump...
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
