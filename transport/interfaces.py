"""Which local addresses a rank listens on and connects from (one per rail), and reading the
host's small text files (/sys, /proc)."""
from __future__ import annotations

import fcntl
import os
import socket
import struct

_SIOCGIFADDR = 0x8915


def read_text(path: str) -> str | None:
    """A small text file's content, stripped (a /sys or /proc entry); None where it cannot be
    read."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def interface_ipv4(ifname: str) -> str:
    """IPv4 address of a local interface, or a clear error naming it."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
    except OSError as e:
        names = ", ".join(n for _, n in socket.if_nameindex())
        raise ValueError(f"LINERATE_SOCKET_IFNAME names {ifname!r}, which has no IPv4 address "
                         f"({e.strerror}); interfaces here: {names}") from None
    finally:
        s.close()
    return socket.inet_ntoa(packed[20:24])


def interface_ipv6(ifname: str) -> str | None:
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[5] == ifname and parts[3] == "00":  # global scope
                    h = parts[0]
                    return ":".join(h[i:i + 4] for i in range(0, 32, 4))
    except OSError:
        pass
    return None


def _route_source(host: str) -> str | None:
    """The local address the kernel would use to reach ``host`` (no packet is sent)."""
    try:
        infos = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, sockaddr in infos:
        s = socket.socket(family, socket.SOCK_DGRAM)
        try:
            s.connect(sockaddr)
            return s.getsockname()[0]
        except OSError:
            continue
        finally:
            s.close()
    return None


def listen_addresses(ifnames: list[str], prefer_ipv6: bool = False) -> list[str]:
    """One address per rail: the named interfaces, else the one that routes to MASTER_ADDR."""
    if ifnames:
        out = []
        for name in ifnames:
            addr = interface_ipv6(name) if prefer_ipv6 else None
            out.append(addr or interface_ipv4(name))
        return out
    master = os.environ.get("MASTER_ADDR")
    if master:
        src = _route_source(master)
        if src:
            return [src]
    try:
        return [socket.gethostbyname(socket.gethostname())]
    except OSError:
        return ["127.0.0.1"]
