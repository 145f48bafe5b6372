"""Who entered a group's collectives last, decided from every rank's view of them: the decision
of collectives/straggler.py (which gathers the views of a running group) and of ``linerate
flight`` (which reads them from the ranks' flight-recorder dumps). Plain Python, no torch: the
``linerate`` command imports it.
"""
from __future__ import annotations

#: Collectives the slowest rank is decided over (the last this many that every view holds).
WINDOW = 64
#: Common collectives needed before anybody is named.
MIN_OPS = 8
#: Share of the window's collectives a rank must enter last to be the slowest.
SHARE = 0.5


def decide(views: dict[int, list], size: int, late_s: float, share: float = SHARE,
           min_ops: int = MIN_OPS, window: int | None = WINDOW) -> dict:
    """The group's verdict from every rank's view.

    ``views``: group rank -> list of ``(seq, seconds, {peer: seconds waited})``, one entry per
    collective (the peer keys are group ranks). Returns ``{"collectives": n, "late": {rank:
    (count, mean lateness s)}, "slowest": rank or None, "skew": {rank: {seq: lateness s}}}``
    over the last ``window`` collectives that every view holds (None: all; ``skew``: each rank's lateness
    relative to the first rank to enter, for the entry skew histogram)."""
    out = {"collectives": 0, "late": {}, "slowest": None, "skew": {}}
    if size < 2 or len(views) < size:
        return out
    by_rank = []
    for r in range(size):
        ops = views.get(r)
        if ops is None:
            return out
        by_rank.append({seq: (d, w) for seq, d, w in ops})
    common = set(by_rank[0])
    for m in by_rank[1:]:
        common &= set(m)
    seqs = sorted(common)
    if window is not None:
        seqs = seqs[-window:]
    counts: dict[int, int] = {}
    sums: dict[int, float] = {}
    skew: dict[int, dict] = {r: {} for r in range(size)}
    for seq in seqs:
        ds = [by_rank[r][seq][0] for r in range(size)]
        hi, lo = max(ds), min(ds)
        last = ds.index(lo)
        for r in range(size):
            skew[r][seq] = hi - ds[r]
        late = hi - lo
        if late < late_s:
            continue
        seen = max((by_rank[r][seq][1].get(last, 0.0) for r in range(size) if r != last),
                   default=0.0)
        if seen < late_s / 2:
            continue
        counts[last] = counts.get(last, 0) + 1
        sums[last] = sums.get(last, 0.0) + late
    n = len(seqs)
    out["collectives"] = n
    out["late"] = {r: (c, sums[r] / c) for r, c in counts.items()}
    out["skew"] = skew
    if n >= min_ops and counts:
        r = max(counts, key=lambda q: (counts[q], sums[q], -q))
        if counts[r] >= share * n:
            out["slowest"] = r
    return out


def describe(rank: int, count: int, n: int, mean_s: float) -> str:
    """'rank 5 entered last in 94% of the last 64 collectives, 38.0 ms late on average'."""
    return (f"rank {rank} entered last in {100.0 * count / n:.0f}% of the last {n:,} "
            f"collectives, {mean_s * 1e3:.1f} ms late on average")


__all__ = ["WINDOW", "MIN_OPS", "SHARE", "decide", "describe"]
