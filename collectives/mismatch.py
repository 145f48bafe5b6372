"""The words for mismatches between ranks, from the facts the transport reports.

The transport compares numbers only (transport/matching.py: opcode, op sequence number (tag),
an opaque call digest, byte counts) and hands each difference over as a ``Mismatch`` record;
what users read is written here, where the opcodes have names. ``OpNames`` is the table of
those names and the wording in one object: the Context takes it as its ``describe``.
"""
from __future__ import annotations

from linerate.transport import CHANNEL_COLLECTIVE


class OpNames(dict):
    """opcode -> collective name; called as ``names(mismatch, rank)`` it words a mismatch
    that rank ``rank`` found (the transport appends where: the group's label)."""

    def name(self, opcode: int) -> str:
        return self.get(opcode, f"op {opcode}")

    def __call__(self, m, rank: int) -> str:
        theirs = self.name(m.their_opcode)
        if m.reason == "call":  # a message of this op's tag whose call digest differs
            if not m.my_desc.startswith(theirs + " "):
                return (f"rank {rank}: rank {m.peer} is in {theirs} #{m.their_tag} while rank "
                        f"{rank} called {m.my_desc}: the ranks called different collectives")
            return (f"rank {rank}: rank {m.peer} called {theirs} #{m.their_tag} with other "
                    f"arguments (dtype, size, reduce op or root) than rank {rank}, which called "
                    f"{m.my_desc}")
        if m.reason == "op":
            return (f"rank {m.peer} is in {theirs} (op #{m.their_tag}, {m.their_total} bytes) "
                    f"while rank {rank} is in {self.name(m.my_opcode)} (op #{m.my_tag}, "
                    f"{m.my_total} bytes): the ranks called different collectives")
        if m.reason == "digest":
            return (f"rank {m.peer} called {theirs} #{m.their_tag} with other arguments (dtype, "
                    f"size, reduce op or root) than rank {rank}, which called {m.my_desc}")
        coll = m.channel == CHANNEL_COLLECTIVE
        what = f"{self.name(m.my_opcode)} op #{m.my_tag}" if coll else f"recv (tag {m.my_tag})"
        return (f"rank {m.peer} sent {m.their_total} bytes but rank {rank} expects {m.my_total} "
                f"bytes in {what}: the ranks passed tensors of different sizes or dtypes")

    def staged_ops(self, ctx, peer: int) -> list[tuple[int, str]]:
        """(op sequence number, op name) of the collective messages from ``peer`` that
        arrived at ``ctx`` and wait for a receive: after a timeout they say which op the
        peer is in."""
        return sorted({(tag, self.name(op)) for channel, tag, op in ctx.staged(peer)
                       if channel == CHANNEL_COLLECTIVE})


__all__ = ["OpNames"]
