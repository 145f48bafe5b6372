"""`linerate probe`: what this host offers the transports.

Lists the network interfaces (state, driver speed, addresses), the RDMA devices and ports
(state, link layer, rate, MTU, LID, GIDs with their type and interface; ``*`` marks the GID
linerate would use), where pyverbs was found, and which transport ``LINERATE_TRANSPORT=auto``
would pick on this host and why. ``auto`` decides for a whole group at rendezvous: RDMA only
when every rank has an active port, so this is one host's half of that answer.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import socket
import struct

from linerate.transport.interfaces import read_text

_SIOCGIFADDR, _SIOCGIFNETMASK = 0x8915, 0x891B


def interfaces() -> list[dict]:
    """Every network interface: name, operstate, driver speed (Mbit/s), addresses."""
    v6: dict[str, list[str]] = {}
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6:
                    addr = socket.inet_ntop(socket.AF_INET6, bytes.fromhex(parts[0]))
                    v6.setdefault(parts[5], []).append(f"{addr}/{int(parts[2], 16)}")
    except OSError:
        pass
    out = []
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in sorted(socket.if_nameindex(), key=lambda x: x[0]):
            addrs = []
            try:
                req = struct.pack("256s", name.encode()[:15])
                ip = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
                mask = fcntl.ioctl(s.fileno(), _SIOCGIFNETMASK, req)[20:24]
                addrs.append(f"{ip}/{bin(int.from_bytes(mask, 'big')).count('1')}")
            except OSError:
                pass
            speed = read_text(f"/sys/class/net/{name}/speed")
            try:
                mbit = int(speed) if speed is not None and int(speed) > 0 else None
            except ValueError:
                mbit = None
            out.append({"name": name, "state": (read_text(f"/sys/class/net/{name}/operstate") or "?").upper(),
                        "speed_mbit": mbit, "addresses": addrs + v6.get(name, [])})
    finally:
        s.close()
    return out


def rdma_report(env=None) -> dict:
    """pyverbs, ports and auto's choice (a dict: what --json prints under "rdma")."""
    from linerate.transport import TransportOptions, rdma, verbs

    opts = TransportOptions.from_env(env)
    out: dict = {"pyverbs": None, "fake": False, "ports": [], "error": None}
    try:
        pv = verbs.load()
        out["pyverbs"], out["fake"] = pv.path, pv.fake
        ports = verbs.list_ports()
    except verbs.RdmaUnavailable as e:
        out["error"] = str(e)
        ports = []
    for p in ports:
        try:
            chosen = verbs.choose_gid(p, opts.rdma_gid_index)
        except verbs.RdmaUnavailable:
            chosen = None
        out["ports"].append({
            "port": p.name, "state": p.state, "link_layer": p.link_layer, "kind": p.kind,
            "rate_gbps": p.rate_gbps, "mtu": p.mtu_bytes, "lid": p.lid,
            "gids": [{"index": g.index, "gid": g.gid, "type": g.type, "netdev": g.netdev,
                      "ipv4": g.ipv4, "chosen": chosen is not None and g.index == chosen.index}
                     for g in p.gids]})
    ok, why, _ = rdma.local_status(opts) if out["error"] is None else \
        (False, "no RDMA device (see above)", 0)
    out["auto"] = {"transport": "rdma" if ok else "tcp",
                   "why": (f"this host has an active RDMA port: {why}; the group uses RDMA if every "
                           f"rank has one" if ok else why)}
    out["setting"] = opts.transport
    return out


def _fmt_speed(mbit) -> str:
    if not mbit:
        return "-"
    return f"{mbit / 1000:g} Gbit/s" if mbit >= 1000 else f"{mbit} Mbit/s"


def render(report: dict) -> str:
    lines = ["Network interfaces:"]
    for i in report["interfaces"]:
        lines.append(f"  {i['name']:<12} {i['state']:<8} {_fmt_speed(i['speed_mbit']):<12} "
                     f"{' '.join(i['addresses']) or '-'}")
    r = report["rdma"]
    lines.append("")
    where = r["pyverbs"] or "not found"
    lines.append(f"RDMA (pyverbs: {where}{', the tests fake' if r['fake'] else ''}):")
    if r["error"]:
        lines.append(f"  none: {r['error']}")
    for p in r["ports"]:
        rate = f"{p['rate_gbps']:g} Gbit/s" if p["rate_gbps"] else "-"
        lines.append(f"  {p['port']:<14} {p['state']:<8} {p['kind']:<11} {rate:<12} MTU {p['mtu']}"
                     f"  LID {p['lid']}")
        for g in p["gids"]:
            mark = "*" if g["chosen"] else " "
            extra = f"  {g['netdev']}" if g["netdev"] else ""
            lines.append(f"    {mark} GID {g['index']:<3} {g['gid']}  {g['type']}{extra}")
    lines.append("")
    a = r["auto"]
    lines.append(f"LINERATE_TRANSPORT=auto would use {a['transport'].upper()} here: {a['why']}")
    lines.append(f"(LINERATE_TRANSPORT is {r['setting']} in this environment)")
    return "\n".join(lines)


def run(args) -> int:
    report = {"interfaces": interfaces(), "rdma": rdma_report()}
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "probe", help="interfaces, RDMA devices and ports, and the transport auto would pick",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=run)


if __name__ == "__main__":
    import sys
    sys.exit(run(argparse.Namespace(json="--json" in sys.argv[1:])))

