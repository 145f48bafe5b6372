"""``linerate timeline``: join and summarize the Chrome traces written with LINERATE_TIMELINE.

    linerate timeline merge /tmp/tl.rank*.json -o /tmp/tl.json    # one file for chrome://tracing
    linerate timeline summary /tmp/tl.rank0.json                   # how much overlapped, per rank
"""
from __future__ import annotations

import argparse
import json
import sys


def _load(path: str) -> list[dict]:
    with open(path) as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:  # a killed run leaves the array open
        data = json.loads(text.rstrip().rstrip(",") + "]")
    return data.get("traceEvents", []) if isinstance(data, dict) else data


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarize(events: list[dict]) -> list[dict]:
    """Per rank: the traced time, how long the link had an all_reduce running, how long
    forward waited for parameters, and how much of the communication overlapped compute."""
    out = []
    for pid in sorted({e.get("pid") for e in events if e.get("ph") == "X"}):
        xs = [e for e in events if e.get("pid") == pid and e.get("ph") == "X"]
        comm = [(e["ts"], e["ts"] + e["dur"]) for e in xs if e["name"].startswith("all_reduce")]
        fwd = [(e["ts"], e["ts"] + e["dur"]) for e in xs if e["name"].startswith("forward")]
        wait = sum(e["dur"] for e in xs if e["name"].startswith("wait"))
        start = min(a for a, _ in comm + fwd) if comm + fwd else 0.0
        end = max(b for _, b in comm + fwd) if comm + fwd else 0.0
        busy = _union(comm)
        both = busy + _union(fwd) - _union(comm + fwd)
        out.append({"rank": pid, "traced_s": (end - start) / 1e6, "comm_busy_s": busy / 1e6,
                    "forward_wait_s": wait / 1e6, "comm_during_forward_s": both / 1e6,
                    "partitions": len(comm)})
    return out


def _cmd_merge(args) -> int:
    from linerate.collectives.timeline import merge
    n = merge(args.files, args.output)
    print(f"{args.output}: {n} events from {len(args.files)} file(s)")
    return 0


def _cmd_summary(args) -> int:
    events = []
    for p in args.files:
        events += _load(p)
    rows = summarize(events)
    if not rows:
        print("no spans in the timeline (was LINERATE_TIMELINE set while training?)")
        return 1
    print(f"{'rank':>4} {'traced s':>9} {'link busy s':>12} {'busy %':>7} {'fwd wait s':>11} "
          f"{'comm under fwd s':>17} {'partitions':>10}")
    for r in rows:
        pct = 100 * r["comm_busy_s"] / r["traced_s"] if r["traced_s"] else 0.0
        print(f"{r['rank']:>4} {r['traced_s']:>9.3f} {r['comm_busy_s']:>12.3f} {pct:>6.1f}% "
              f"{r['forward_wait_s']:>11.3f} {r['comm_during_forward_s']:>17.3f} {r['partitions']:>10}")
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("timeline", help="merge or summarize LINERATE_TIMELINE traces",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="timeline_command", metavar="ACTION", required=True)
    m = sub.add_parser("merge", help="join the ranks' files into one Chrome trace")
    m.add_argument("files", nargs="+")
    m.add_argument("-o", "--output", required=True)
    m.set_defaults(func=_cmd_merge)
    s = sub.add_parser("summary", help="per rank: link busy time, forward waits, overlap")
    s.add_argument("files", nargs="+")
    s.set_defaults(func=_cmd_summary)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="linerate")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
