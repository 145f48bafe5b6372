"""``linerate flight``: read the flight-recorder dumps of all ranks and say what went wrong.

    linerate flight /tmp/linerate-flight.rank*.json     # the files
    linerate flight /tmp/                               # every dump in a folder
    linerate flight /tmp/linerate-flight                # a LINERATE_FR_DUMP prefix
    linerate flight --json /tmp/                        # the same, as JSON

Each rank writes one dump when a collective of one of its groups times out (LINERATE_FR_DUMP,
LINERATE_FR_ENTRIES). Per group and sequence number this says which ranks entered the op and
which never joined it (and what each of those did last), which ranks called different ops at
the same sequence number, and the first op that did not complete on every rank. Ranks are
global ranks.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

from linerate.collectives.flight import KIND, VERSION
from linerate.collectives.lateness import decide, describe


class DumpError(Exception):
    """A file that cannot be read as a dump (the message names it)."""


# ----------------------------------------------------------------------------- reading
def _is_dump_name(path: str) -> bool:
    return path.endswith(".json") and ".tmp" not in os.path.basename(path)


def find_files(args: list[str]) -> list[str]:
    """Dump files from files, folders (their ``*.json``) and LINERATE_FR_DUMP prefixes."""
    files: list[str] = []
    for a in args:
        if os.path.isdir(a):
            found = sorted(p for p in glob.glob(os.path.join(a, "*.json")) if _is_dump_name(p))
            found = [p for p in found if _looks_like_dump(p)]
            if not found:
                raise DumpError(f"{a}: no flight-recorder dump in this folder")
            files += found
        elif os.path.exists(a):
            files.append(a)
        else:
            pattern = a.replace("{rank}", "*") if "{rank}" in a else \
                (a[:-5] if a.endswith(".json") else a) + ".rank*.json"
            found = sorted(p for p in glob.glob(pattern) if _is_dump_name(p))
            if not found:
                raise DumpError(f"{a}: no such file, folder, or dump prefix (looked for {pattern})")
            files += found
    seen, out = set(), []
    for f in files:
        key = os.path.realpath(f)
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out


def _looks_like_dump(path: str) -> bool:
    """In a folder: skip other JSON files (timelines, ...) without reading them whole."""
    try:
        with open(path, "rb") as f:
            head = f.read(200)
    except OSError:
        return True  # named as unreadable by load()
    return KIND.encode() in head or not head.lstrip().startswith(b"{")


def _need(cond: bool, path: str, why: str) -> None:
    if not cond:
        raise DumpError(f"{path}: not a linerate flight-recorder dump: {why}")


def load(path: str) -> dict:
    """One rank's dump, checked; a DumpError names the file and what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise DumpError(f"{path}: cannot read: {e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DumpError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
                        f"a truncated or foreign file?") from None
    _need(isinstance(data, dict), path, "the top level is not a JSON object")
    _need(data.get("kind") == KIND, path, f"its 'kind' is {data.get('kind')!r}, not {KIND!r}")
    v = data.get("version")
    _need(isinstance(v, int), path, "no integer 'version'")
    if v > VERSION:
        raise DumpError(f"{path}: dump format version {v} is newer than this linerate reads "
                        f"({VERSION}); use the linerate that wrote it")
    _need(isinstance(data.get("rank"), int), path, "no integer 'rank'")
    groups = data.get("groups")
    _need(isinstance(groups, list), path, "no 'groups' list")
    for i, g in enumerate(groups):
        where = f"group {i}"
        _need(isinstance(g, dict) and isinstance(g.get("name"), str), path, f"{where} has no name")
        ranks = g.get("ranks")
        _need(isinstance(ranks, list) and ranks and all(isinstance(r, int) for r in ranks), path,
              f"{where} has no 'ranks' list")
        _need(isinstance(g.get("rank"), int) and 0 <= g["rank"] < len(ranks), path,
              f"{where}: its 'rank' is not an index into 'ranks'")
        ops = g.get("ops")
        _need(isinstance(ops, list), path, f"{where} has no 'ops' list")
        for op in ops:
            _need(isinstance(op, dict) and isinstance(op.get("seq"), int)
                  and isinstance(op.get("op"), str) and isinstance(op.get("state"), str), path,
                  f"{where}: an op without integer 'seq', 'op' and 'state': {str(op)[:120]}")
    return data


# ----------------------------------------------------------------------------- analysis
def _ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}"


def _call(e: dict) -> str:
    return f"{e['op']} [{e.get('desc') or ''}]"


def analyze(dumps: list[tuple[str, dict]], late_ms: float = 5.0) -> dict:
    """Per group: which ranks entered each op that did not complete everywhere, which never
    joined it (and their last op), mismatched calls, and the first such op."""
    groups: dict[str, dict] = {}
    notes: list[str] = []
    for path, d in dumps:
        for g in d["groups"]:
            me = g["ranks"][g["rank"]]
            slot = groups.setdefault(g["name"], {"per": {}, "files": {}, "desc": g.get("desc", ""),
                                                 "ranks": list(g["ranks"])})
            if g["ranks"] != slot["ranks"]:
                notes.append(f"group {g['name']}: {path} lists ranks {g['ranks']}, another dump "
                             f"{slot['ranks']} (two jobs' dumps mixed?)")
            if me in slot["per"]:
                other = slot["files"][me]
                notes.append(f"group {g['name']}: two dumps of rank {me} ({other}, {path}); "
                             f"the later one is used")
                if d.get("time", 0) < slot.get("times", {}).get(me, 0):
                    continue
            slot["per"][me] = g
            slot["files"][me] = path
            slot.setdefault("times", {})[me] = d.get("time", 0)
    out = {"version": VERSION, "files": [p for p, _ in dumps], "notes": notes, "groups": []}
    for name in sorted(groups, key=lambda n: (not n.isdigit(), int(n) if n.isdigit() else 0, n)):
        out["groups"].append(_analyze_group(name, groups[name], late_ms))
    return out


def _late(ranks: list, dumped: list, ops: dict, late_ms: float) -> dict | None:
    """Who entered the group's completed ops last, from every rank's durations and waits
    (collectives/lateness.py decide, over every op completed on all ranks): None without a
    dump of every rank."""
    if len(dumped) != len(ranks) or len(ranks) < 2:
        return None
    index = {g: i for i, g in enumerate(ranks)}
    views = {}
    for g in dumped:
        view = []
        for e in ops[g].values():
            if e["state"] != "completed" or not all(isinstance(e.get(k), (int, float))
                                                     for k in ("started", "ended")):
                continue
            waited = {}
            for w in e.get("waited") or []:
                if (isinstance(w, list) and len(w) == 2 and isinstance(w[0], int)
                        and 0 <= w[0] < len(ranks) and isinstance(w[1], (int, float))):
                    waited[w[0]] = float(w[1])
            view.append((e["seq"], max(0.0, e["ended"] - e["started"]), waited))
        views[index[g]] = view
    v = decide(views, len(ranks), late_ms / 1e3, window=None)
    n = v["collectives"]
    late = [{"rank": ranks[r], "entered_last": c, "share": c / n, "mean_late_s": round(m, 6)}
            for r, (c, m) in sorted(v["late"].items(), key=lambda kv: (-kv[1][0], kv[0]))]
    slowest = v["slowest"]
    text = ""
    if slowest is not None:
        c, m = v["late"][slowest]
        text = describe(ranks[slowest], c, n, m)
    return {"collectives": n, "slowest": None if slowest is None else ranks[slowest],
            "text": text, "ranks": late}


def _analyze_group(name: str, slot: dict, late_ms: float = 5.0) -> dict:
    per: dict[int, dict] = slot["per"]
    ranks = slot["ranks"]
    dumped = sorted(per)
    missing = [r for r in ranks if r not in per]
    ops = {r: {e["seq"]: e for e in per[r]["ops"]} for r in dumped}
    # The records are bounded: below the newest first-recorded seq some ranks forgot the op.
    lo = max((min(o) for o in ops.values() if o), default=0)
    seqs = sorted({s for o in ops.values() for s in o if s >= lo})
    result = {"name": name, "desc": slot["desc"], "ranks": ranks, "dumps": dumped,
              "missing_dumps": missing, "window": [seqs[0], seqs[-1]] if seqs else None,
              "files": {str(r): slot["files"][r] for r in dumped},
              "ops": [], "mismatches": [], "first_incomplete": None}
    result["late"] = _late(ranks, dumped, ops, late_ms)
    for s in seqs:
        entries = {r: ops[r].get(s) for r in dumped}
        present = {r: e for r, e in entries.items() if e is not None}
        calls = {}
        for r, e in present.items():
            calls.setdefault(_call(e), []).append(r)
        if len(calls) > 1:
            result["mismatches"].append({"seq": s, "calls": [{"call": c, "ranks": rs}
                                                             for c, rs in calls.items()]})
        if all(e is not None and e["state"] == "completed" for e in entries.values()):
            continue
        entered = sorted(r for r, e in present.items() if e.get("started") is not None)
        first_in = min((present[r]["started"] for r in entered), default=None)
        never = []
        for r in dumped:
            if r in entered:
                continue
            last = None
            for q in sorted(ops[r], reverse=True):
                if q < s and ops[r][q].get("started") is not None:
                    last = ops[r][q]
                    break
            late = None
            e = entries[r]
            if e is not None and first_in is not None and isinstance(e.get("queued"), (int, float)):
                late = round(e["queued"] - first_in, 3)
            never.append({"rank": r, "called": e is not None, "state": e["state"] if e else None,
                          "called_after_s": late,
                          "last_seq": last["seq"] if last else None,
                          "last_op": last["op"] if last else None,
                          "last_state": last["state"] if last else None})
        awaited: dict[int, list[int]] = {}
        for r, e in present.items():
            for q in e.get("awaited") or []:
                if isinstance(q, int) and 0 <= q < len(ranks):
                    awaited.setdefault(ranks[q], []).append(r)
        head = next(iter(present.values()))
        info = {"seq": s, "op": head["op"], "desc": head.get("desc") or "", "entered": entered,
                "never_joined": never,
                "states": {str(r): (e["state"] if e else "not called") for r, e in entries.items()},
                "awaited": {str(q): sorted(by) for q, by in sorted(awaited.items())},
                "errors": {str(r): e.get("error") for r, e in present.items() if e.get("error")},
                "mismatch": len(calls) > 1}
        result["ops"].append(info)
        if result["first_incomplete"] is None:
            result["first_incomplete"] = s
    return result


# ----------------------------------------------------------------------------- text
def _never_text(n: dict, op: str, s: int) -> str:
    t = f"rank {n['rank']} never joined"
    if n["last_seq"] is not None:
        t += f" — its last op was #{n['last_seq']}"
        if n["last_op"] != op:
            t += f" ({n['last_op']})"
        t += f", {n['last_state']}"
        if n["last_state"] == "started":
            t += " (still running)"
    else:
        t += " — it entered no op of this group in its record"
    if n["called"]:
        when = (f" {n['called_after_s']:.1f} s after the first rank entered"
                if n["called_after_s"] is not None else "")
        t += f"; it called {op} #{s}{when}"
        if n["state"] == "failed":
            t += ", when the group had already failed"
        elif n["state"] == "queued":
            t += " but it never started"
    return t


def report(result: dict) -> str:
    lines = []
    nfiles = len(result["files"])
    lines.append(f"{nfiles} dump{'s' if nfiles != 1 else ''}, {len(result['groups'])} "
                 f"group{'s' if len(result['groups']) != 1 else ''}")
    for note in result["notes"]:
        lines.append(f"note: {note}")
    for g in result["groups"]:
        desc = f", {g['desc']}" if g["desc"] else ""
        lines.append("")
        lines.append(f"group {g['name']} ({len(g['ranks'])} ranks{desc}): dumps from "
                     f"{_ranks_text(g['dumps'])}" + (f"; no dump from {_ranks_text(g['missing_dumps'])}"
                                                      if g["missing_dumps"] else ""))
        if g["window"]:
            lines.append(f"  records from #{g['window'][0]} to #{g['window'][1]}")
        for m in g["mismatches"]:
            parts = "; ".join(f"{_ranks_text(c['ranks'])} called {c['call']}" for c in m["calls"])
            lines.append(f"  MISMATCH at #{m['seq']}: {parts}")
        late = g.get("late")
        if late and late["slowest"] is not None:
            lines.append(f"  {late['text']}")
        elif late and late["ranks"]:
            lines.append("  entered late (no rank in most of the " f"{late['collectives']:,} "
                         "completed collectives): " + ", ".join(
                             f"rank {x['rank']} in {x['entered_last']}, "
                             f"{x['mean_late_s'] * 1e3:.1f} ms on average" for x in late["ranks"]))
        if not g["ops"]:
            lines.append("  every recorded op completed on every dumped rank")
            continue
        for op in g["ops"]:
            s = op["seq"]
            text = f"  {op['op']} #{s} (group {g['name']}): "
            text += f"{_ranks_text(op['entered'])} entered" if op["entered"] else "no rank entered"
            if op["never_joined"]:
                text += "; " + "; ".join(_never_text(n, op["op"], s) for n in op["never_joined"])
            lines.append(text)
            states: dict[str, list[int]] = {}
            for r, st in op["states"].items():
                states.setdefault(st, []).append(int(r))
            lines.append("    states: " + ", ".join(f"{st} on {_ranks_text(rs)}"
                                                    for st, rs in sorted(states.items())))
            for q, by in op["awaited"].items():
                lines.append(f"    {_ranks_text(by)} still waited for rank {q} when they gave up")
        first = next(o for o in g["ops"] if o["seq"] == g["first_incomplete"])
        lines.append(f"  first op that did not complete everywhere: {first['op']} #{first['seq']} "
                     f"[{first['desc']}]")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command
def _cmd(args) -> int:
    try:
        files = find_files(args.paths)
        dumps = [(p, load(p)) for p in files]
    except DumpError as e:
        print(f"linerate flight: {e}", file=sys.stderr)
        return 2
    result = analyze(dumps, args.late_ms)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(report(result))
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("flight", help="read the ranks' flight-recorder dumps: who never "
                              "joined which op", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="dump files, folders holding them, or a LINERATE_FR_DUMP prefix")
    p.add_argument("--json", action="store_true", help="the analysis as JSON")
    p.add_argument("--late-ms", type=float, default=5.0, metavar="MS",
                   help="a rank entering an op at least this much after the others is late "
                        "(default 5, as LINERATE_SLOW_RANK_MS)")
    p.set_defaults(func=_cmd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="linerate")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
