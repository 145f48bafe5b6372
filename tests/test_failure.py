"""transport/failure.py on its own: the root cause a rank keeps and the errors that name it,
with a stand-in for the Context (no link, no process)."""
from __future__ import annotations

import types

from linerate.transport.failure import BECAUSE, Failures, error_payload, root_text, wrap
from linerate.transport.framing import MAX_ERROR_BYTES
from linerate.transport.request import PeerFailure, TransportError


class _Ctx(types.SimpleNamespace):
    """A stand-in for the Context (Failures holds it weakly)."""


def _ctx(rank=0, peers=(1, 2, 3)):
    peer = lambda r: types.SimpleNamespace(rank=r, root=None, link=None, failure=None,  # noqa: E731
                                          pending=[], told=False)
    return _Ctx(rank=rank, peers={r: peer(r) for r in peers}, shm=None, closing=False,
                where=lambda: " [in all_reduce #3]")


def test_the_first_failure_noted_is_the_root_and_wrappers_are_dropped():
    ctx = _ctx()
    f = Failures(ctx)
    assert f.root_cause() is None and f.root_value() == 0
    text = f"rank 1: {BECAUSE.format(2)}rank 2: out of memory"
    assert f.note_root(2, text) == (2, "rank 2: out of memory")
    assert f.note_root(3, "rank 3: later") == (2, "rank 2: out of memory")  # the first wins
    assert f.root_cause() == (2, "rank 2: out of memory")
    assert f.root_value() == 3  # an ERROR frame's value: root + 1
    assert root_text(2, BECAUSE.format(2) + BECAUSE.format(2) + "x") == "x"
    assert root_text(2, "no wrapper") == "no wrapper"


def test_a_peer_found_gone_is_named_only_where_nobody_else_is_the_cause():
    ctx = _ctx()
    f = Failures(ctx)
    err = f.lost(1, "rank 0: all_reduce #3: rank 1 exited", "rank 0: all_reduce #3")
    assert str(err) == "rank 0: all_reduce #3: rank 1 exited" and err.root == 1
    # rank 1 said (its ERROR frame) that it failed because of rank 3
    ctx.peers[1].root = (3, "rank 3: killed")
    assert f.cause_of(1) == (3, "rank 3: killed")
    err = f.lost(1, "rank 0: all_reduce #3: rank 1 exited", "rank 0: all_reduce #3")
    assert err.root == 3
    assert str(err) == ("rank 0: all_reduce #3: the group failed because of rank 3: "
                        "rank 3: killed [in all_reduce #3]")


def test_a_crashed_peer_becomes_the_root_unless_it_named_another():
    ctx = _ctx()
    f = Failures(ctx)
    gone = PeerFailure(2, "rank 2 closed the connection")
    ctx.closing = True  # no wait for an ERROR frame that will not come
    assert f._lost_error(2, gone, crashed=True) is gone
    assert f.root_cause() == (2, "rank 2 closed the connection")
    f2 = Failures(ctx)
    ctx.peers[1].root = (3, "rank 3: out of memory")
    named = f2._lost_error(1, PeerFailure(1, "rank 1 closed"), crashed=True)
    assert isinstance(named, PeerFailure) and named.peer == 1
    assert str(named) == "rank 0: the group failed because of rank 3: rank 3: out of memory"
    assert f2.root_cause() == (3, "rank 3: out of memory")


def test_error_payload_and_wrap():
    assert len(error_payload("x" * (MAX_ERROR_BYTES + 10))) == MAX_ERROR_BYTES
    assert error_payload("é") == "é".encode()
    e = PeerFailure(4, "rank 4 died")
    w = wrap(e)
    assert w is not e and isinstance(w, PeerFailure) and w.peer == 4 and str(w) == str(e)
    w = wrap(ValueError("bad"))
    assert type(w) is TransportError and str(w) == "bad"
