"""LINERATE_CHECKSUM=1: a CRC-32 after every chunk, checked on receipt."""
from __future__ import annotations

import struct
import threading
import time
import zlib

import numpy as np
import pytest

from _harness import run_ranks
from test_transport import FakePeer, _hash_store, _opts, mesh
from linerate.transport import CHANNEL_P2P, Context, TransportError, TransportOptions


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [0, 1, 65_535, 3 * 65_536 + 7, 2 << 20])
def test_checksummed_transfers_arrive_intact(n):
    rng = np.random.default_rng(n)
    with mesh(3, nsocks=2, chunk_bytes=64 * 1024, checksum=True) as ctxs:
        src = rng.integers(0, 256, n, dtype=np.uint8)
        dsts = [np.zeros(n, np.uint8) for _ in range(2)]
        rs = [ctxs[r].irecv(0, memoryview(dsts[r - 1]), CHANNEL_P2P, 3) for r in (1, 2)]
        ss = [ctxs[0].isend(r, memoryview(src), CHANNEL_P2P, 3) for r in (1, 2)]
        for q in rs + ss:
            q.wait(30)
        for d in dsts:
            np.testing.assert_array_equal(src, d)


@pytest.mark.timeout(60)
def test_ranks_must_agree_on_checksums():
    store = _hash_store()
    errors: list = []
    ctxs: list = []

    def build(rank, on):
        try:
            ctxs.append(Context(store, rank, 2, _opts(checksum=on)))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=build, args=(0, True), daemon=True),
               threading.Thread(target=build, args=(1, False), daemon=True)]
    t0 = time.monotonic()
    threads[1].start()
    threads[0].start()
    for t in threads:
        t.join(30)
    took = time.monotonic() - t0
    for c in ctxs:
        c.close(timeout=1.0)
    assert not ctxs, "a group with different checksum settings was built"
    assert any(isinstance(e, ValueError) and "LINERATE_CHECKSUM is 0 here but 1 on rank 0"
               in str(e) for e in errors), errors
    # rank 0 fails too, at once (not after LINERATE_CONNECT_TIMEOUT), with rank 1's reason
    assert any(isinstance(e, TransportError) and str(e).startswith("rank 0: another rank failed")
               and "rank 1: LINERATE_CHECKSUM is 0 here" in str(e) for e in errors), errors
    assert took < 10, took


@pytest.mark.timeout(60)
def test_corrupted_chunk_fails_with_a_clear_error():
    fake = FakePeer(checksum=True)
    try:
        ctx = fake.ctx
        buf = np.zeros(1000, np.uint8)
        r = ctx.irecv(1, memoryview(buf), CHANNEL_P2P, 9)
        payload = bytes(range(256)) * 3 + bytes(232)
        fake.data(CHANNEL_P2P, 9, 0, 1000, 0, payload)
        fake.sock.sendall(struct.pack("<I", zlib.crc32(payload) ^ 1))  # one bit flipped
        with pytest.raises(TransportError, match="checksum mismatch in bytes \\[0, 1000\\)"):
            r.wait(10)
    finally:
        fake.close()


def test_setting_from_env():
    assert TransportOptions.from_env({"LINERATE_CHECKSUM": "1"}).checksum is True
    with pytest.raises(ValueError, match="LINERATE_CHECKSUM"):
        TransportOptions.from_env({"LINERATE_CHECKSUM": "maybe"})


def _collectives(rank, world, lr):
    import torch
    import torch.distributed as dist
    t = torch.arange(3_000_001, dtype=torch.float64) + rank
    dist.all_reduce(t, group=lr)
    want = torch.arange(3_000_001, dtype=torch.float64) * world + sum(range(world))
    b = torch.full((1001,), float(rank))
    dist.broadcast(b, 1, group=lr)
    return bool(torch.equal(t, want)) and bool((b == 1).all())


@pytest.mark.timeout(90)
def test_backend_with_checksums():
    assert run_ranks(_collectives, 3, timeout=80, env={"LINERATE_CHECKSUM": "1"}) == [True] * 3
