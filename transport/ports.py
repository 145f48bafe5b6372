"""Listening sockets within LINERATE_PORT_RANGE.

Every socket linerate listens on (a rank's TCP listeners, one per interface: transport/tcp.py;
the link probe's receivers: tools/linkprobe.py) takes any free port, or with
``LINERATE_PORT_RANGE=LOW-HIGH`` the first free port of that range, so that a firewall need open
only the range. A range with no free port left is an error naming the setting.
"""
from __future__ import annotations

import errno
import socket

from .request import TransportError


class PortRangeExhausted(TransportError):
    """No port of LINERATE_PORT_RANGE is free on the address."""


def _family(addr: str) -> int:
    return socket.AF_INET6 if ":" in addr else socket.AF_INET


def listen_on(addr: str, backlog: int, port_range: tuple[int, int] | None, who: str = "",
              reuse: bool = True) -> socket.socket:
    """A TCP socket listening on ``addr``: on any free port (``port_range`` None), else on the
    first free port of ``(low, high)`` (both included). ``who`` starts the error's message
    (``"rank 3"``). A port another socket listens on (or binds, not listening yet) is skipped:
    both ``bind`` and ``listen`` may find it taken."""
    family = _family(addr)
    ports = [0] if port_range is None else range(port_range[0], port_range[1] + 1)
    for port in ports:
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            if reuse:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((addr, port))
            s.listen(backlog)
            return s
        except OSError as e:
            s.close()
            if port_range is None or e.errno not in (errno.EADDRINUSE, errno.EACCES):
                raise
    lo, hi = port_range
    raise PortRangeExhausted(
        f"{who + ': ' if who else ''}no free port in LINERATE_PORT_RANGE={lo}-{hi} on {addr} "
        f"(all {hi - lo + 1} taken): widen the range; every rank of a host listens on one port "
        f"per interface")


__all__ = ["listen_on", "PortRangeExhausted"]
