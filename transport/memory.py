"""Large buffers that go back to the kernel the moment they are dropped.

glibc serves a large ``malloc`` with its own ``mmap`` until one is freed; from then on it raises
its threshold to that size (up to 32 MiB) and serves the next ones from a heap or a thread's
arena, which keeps freed memory as slack wherever it is not at the top. How much a process keeps
after a large operation then depends on which thread freed what in which order (up to tens of
MiB after one large all_reduce, differing from one op to the next). The matcher's staging buffers (messages that
arrive before their receive: allocated on a receiving thread, freed on another) of
``ANON_BYTES`` and more are anonymous mappings of their own instead: their pages are the
kernel's again when the last view of them goes, whoever allocated or freed them.

Not the collectives' scratch (collectives/comm.Scratch): it is kept between ops and trimmed to
LINERATE_KEEP_BYTES after each, and a fresh mapping per op would cost a fault and a zeroing per
page, a large share of a big op's time.
"""
from __future__ import annotations

import mmap

import numpy as np

#: From this size a buffer is an anonymous mapping of its own.
ANON_BYTES = 256 << 10


def anon_bytes(n: int) -> memoryview:
    """A writable buffer of ``n`` bytes (contents undefined), unmapped when dropped."""
    if n < ANON_BYTES:
        return memoryview(np.empty(n, np.uint8))
    return memoryview(mmap.mmap(-1, n))


__all__ = ["ANON_BYTES", "anon_bytes"]
