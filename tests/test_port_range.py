"""LINERATE_PORT_RANGE: every socket linerate listens on binds within the range (real sockets
on 127.0.0.1); a range with no free port fails group creation on every rank naming the
setting; a malformed range is refused naming it."""
from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from _harness import free_port_range
from _threads import run_threads, sync

pytestmark = pytest.mark.timeout(120)


def _tcp_options(port_range: str):
    import linerate
    o = linerate.Options()
    o.transport.shm = "0"            # ranks of one host: TCP only, so that they listen
    o.transport.port_range = port_range
    return o


def test_every_rank_listens_within_the_range_and_the_group_works():
    base = free_port_range(8)
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", base))  # taken (bound, not listening): skipped
    blocker2 = socket.socket()
    blocker2.bind(("127.0.0.1", base + 1))
    blocker2.listen(1)                  # taken (listening): skipped
    try:
        def fn(pg, r):
            # lazy links (the default): the ports each rank published for its peers' dials (its
            # listeners close once every peer is linked, which a rank that starts late may
            # find already done)
            ports = [port for _, port in pg._ctx._maker._remote[r]]
            t = torch.full((1000,), float(r + 1))
            pg.allreduce([t], sync()).wait()
            return t[0].item(), ports

        res = run_threads(fn, 3, options=_tcp_options(f"{base}-{base + 7}"))
    finally:
        blocker.close()
        blocker2.close()
    assert [v for v, _ in res] == [6.0] * 3
    ports = sorted(p for _, ps in res for p in ps)
    assert len(set(ports)) == 3 and all(base + 2 <= p <= base + 7 for p in ports), (base, ports)


def test_a_range_with_no_free_port_fails_every_rank_naming_the_setting():
    import threading
    from datetime import timedelta

    from linerate.collectives.backend import ProcessGroupLinerate
    base = free_port_range(2)
    spec = f"{base}-{base + 1}"           # 2 ports for 3 ranks of one host
    store, errors = dist.HashStore(), {}

    def rank(r: int) -> None:
        try:
            pg = ProcessGroupLinerate(dist.PrefixStore("pr", store), r, 3, timedelta(seconds=20),
                                      _tcp_options(spec), group_name="pr")
            pg.shutdown()
        except BaseException as e:  # noqa: BLE001 - the outcome under test
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank still sets the group up"
    assert sorted(errors) == [0, 1, 2], errors
    for e in errors.values():
        assert f"no free port in LINERATE_PORT_RANGE={spec}" in str(e), e


def test_a_malformed_range_is_refused_naming_the_setting(monkeypatch):
    import linerate
    for bad in ("30000", "30010-30000", "0-10", "1-65536", "a-b"):
        monkeypatch.setenv("LINERATE_PORT_RANGE", bad)
        with pytest.raises(ValueError, match="LINERATE_PORT_RANGE"):
            linerate.Options.from_env()
    o = linerate.Options()
    o.transport.port_range = "9-8"
    with pytest.raises(ValueError, match="LINERATE_PORT_RANGE"):
        o.transport.validate()
    monkeypatch.setenv("LINERATE_PORT_RANGE", " 30000 - 30010 ")
    assert linerate.Options.from_env().transport.ports == (30000, 30010)


def test_listen_on_takes_the_first_free_port_and_names_the_setting_when_none_is():
    from linerate.transport.ports import PortRangeExhausted, listen_on
    base = free_port_range(3)
    a = listen_on("127.0.0.1", 4, (base, base + 2), "rank 0")
    b = listen_on("127.0.0.1", 4, (base, base + 2), "rank 1")
    c = listen_on("127.0.0.1", 4, (base, base + 2), "rank 2")
    try:
        assert [s.getsockname()[1] for s in (a, b, c)] == [base, base + 1, base + 2]
        with pytest.raises(PortRangeExhausted, match=rf"rank 3: no free port in "
                                                      rf"LINERATE_PORT_RANGE={base}-{base + 2}"):
            listen_on("127.0.0.1", 4, (base, base + 2), "rank 3")
    finally:
        for s in (a, b, c):
            s.close()
    any_port = listen_on("127.0.0.1", 4, None)
    try:
        assert any_port.getsockname()[1] > 0
    finally:
        any_port.close()


def test_link_probe_receivers_listen_within_the_range(monkeypatch):
    from linerate.tools import linkprobe
    base = free_port_range(2)
    monkeypatch.setenv("LINERATE_PORT_RANGE", f"{base}-{base + 1}")
    r1 = linkprobe._Receiver("127.0.0.1", 1, 5.0, "rank 0 -> rank 1")
    try:
        assert r1.port == base
        assert base <= linkprobe._free_port("127.0.0.1") <= base + 1
        r2 = linkprobe._Receiver("127.0.0.1", 1, 5.0, "rank 1 -> rank 2")
        try:
            assert r2.port == base + 1
            with pytest.raises(linkprobe.LinkProbeError, match="LINERATE_PORT_RANGE"):
                linkprobe._Receiver("127.0.0.1", 1, 5.0, "rank 2 -> rank 0")
        finally:
            r2.listener.close()
    finally:
        r1.listener.close()
