"""Fixtures and markers shared by the test files (their plain helpers are in tests/_harness.py).

- ``@pytest.mark.netlab``: the test needs netlab (root, iproute2, network namespaces); it is
  skipped with the reason where netlab cannot work.
- ``transport``: runs a transport test once per transport, ``tcp``; ``rdma-fake`` (the RDMA
  transport on the fake pyverbs of tests/fake_pyverbs); ``rdma`` (this machine's real RDMA
  device, skipped with the reason where there is none).
- ``lab_name``: a netlab lab name unique to the test, torn down afterwards whatever happened.

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
