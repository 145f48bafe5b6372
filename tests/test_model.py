"""`linerate model` (step-time model, recommendation) and `linerate whatif` (the what-if
analysis): formulas against hand-computed cases, the CLIs, and a netlab --measure run.

Hand-computed cases use round numbers: M = 1e6 bytes, 8 Gbit/s = 1e9 bytes/s,
80 Gbit/s = 1e10 bytes/s, latencies 0 unless the test is about latency.
"""
from __future__ import annotations

import json
import sys
import uuid

import pytest

from tools import cli, model
from tools.model import Cluster, Pattern, predict, recommend
from tools import whatif
from tools.whatif import AddCost, Bucket, Grad, make_buckets, schedule, scaling_factor

M = 1_000_000
MS = 1e-3


def approx(x, rel=1e-9, abs=1e-12):
    return pytest.approx(x, rel=rel, abs=abs)


def two_tier(nodes=2, rpn=4, intra=80.0, inter=8.0, **kw):
    """intra 80 Gbit/s = 1e10 B/s per rank link, inter 8 Gbit/s = 1e9 B/s per uplink."""
    kw.setdefault("intra_latency_s", 0.0)
    kw.setdefault("inter_latency_s", 0.0)
    return Cluster(nodes, rpn, intra, inter, **kw)


# ----------------------------------------------------------------------------- All-Reduce

def test_allreduce_flat_hand_computed():
    c = Cluster(1, 4, 8.0, 8.0, intra_latency_s=50e-6, inter_latency_s=1.0)
    p = predict(c, M, 1.5 * MS, method="allreduce")
    # T_ar = 2*3*50us + 2*3/4 * 1e6 / 1e9 = 0.3 ms + 1.5 ms; the inter latency is unused.
    assert p["comm_s"] == approx(1.8 * MS)
    # T = T_fwd + max(T_bwd, T_ar) = 0.5 + max(1.0, 1.8) ms
    assert p["step_s"] == approx(2.3 * MS)
    assert p["compute_s"] == 1.5 * MS and "T_fwd + max(T_bwd, T_ar)" in p["formula"]
    assert p["allreduce"]["beta_eff_gbit"] == approx(8.0)
    # backward longer than T_ar: All-Reduce is hidden, T = compute
    assert predict(c, M, 6 * MS)["step_s"] == approx(6 * MS)


def test_allreduce_two_tier_one_ring_flow_per_uplink():
    c = two_tier()
    ar = model.ring_allreduce(c, M)
    # node-major ring: only 3 -> 4 leaves node 0 and 7 -> 0 leaves node 1
    assert ar["uplink_flows"] == 1
    assert ar["beta_eff_gbit"] == approx(8.0)           # min(80, 8 / 1 flow)
    assert ar["seconds"] == approx(2 * 7 / 8 * M / 1e9)  # 1.75 ms
    assert ar["bottleneck"].startswith("uplink")
    # an uplink faster than a rank link: the rank link is the slowest a ring crosses
    fast_up = two_tier(intra=8.0, inter=80.0)
    assert model.ring_allreduce(fast_up, M)["beta_eff_gbit"] == approx(8.0)
    assert model.ring_allreduce(fast_up, M)["bottleneck"].startswith("rank")


def test_allreduce_latency_term():
    flat = Cluster(1, 4, 8.0, 8.0, intra_latency_s=1e-3, inter_latency_s=5e-3)
    ar = predict(flat, 1, 0.0)["allreduce"]
    assert ar["latency_s"] == approx(2 * 3 * 1e-3)                        # 2(n-1) a_intra
    assert ar["seconds"] == approx(6e-3 + 1.5 / 1e9)
    tiered = Cluster(2, 2, 8.0, 8.0, intra_latency_s=1e-3, inter_latency_s=2e-3)
    assert predict(tiered, 1, 0.0)["allreduce"]["latency_s"] == approx(2 * 3 * 2e-3)
    assert predict(Cluster(1, 1, 8.0, 8.0), M, 0.01)["comm_s"] == 0.0       # one rank
    assert predict(flat, 0, 0.01)["comm_s"] == 0.0                          # nothing to send


def test_overlap_off_and_cpu_contention():
    c = two_tier()
    t_ar = 1.75 * MS
    assert predict(c, M, 3 * MS, overlap=False)["step_s"] == approx(3 * MS + t_ar)
    # c = 2: no overlap at all; c = 1.5: max + 0.5 * min of backward (2 ms) and T_ar
    assert predict(c, M, 3 * MS, cpu_contention=2.0)["step_s"] == approx(3 * MS + t_ar)
    assert predict(c, M, 3 * MS, cpu_contention=1.5)["step_s"] == approx(
        1 * MS + 2 * MS + 0.5 * t_ar)
    assert predict(c, M, 3 * MS, method="ring", cpu_contention=2.0)["step_s"] == approx(
        3 * MS + 2 * MS)
    with pytest.raises(ValueError):
        predict(c, M, 3 * MS, cpu_contention=3.0)
    # fwd_fraction 1: nothing of the compute overlaps the All-Reduce
    assert predict(c, M, 3 * MS, fwd_fraction=1.0)["step_s"] == approx(3 * MS + t_ar)


# ----------------------------------------------------------------------------- topologies

# 2 nodes x 4 ranks, rank links 1e10 B/s, uplinks 1e9 B/s, M = 1e6 B: exchange time per step
# of the period, by hand (see each line), and the uplink flows of the busiest step.
HAND = {
    # peers i-1, i+1: node 0's uplink carries 3->4 and 0->7
    "ring": ([2.0 * MS], 2),
    # 2 x 4 torus = one row per node: 2 peers in the row, 1 (up = down) in the other node
    "torus": ([4.0 * MS], 4),
    # sends to i-1, i-2, i-4: 1 + 2 + 4 = 7 of node 0's 12 flows cross its uplink
    "exp": ([7.0 * MS], 7),
    # sends to i-h, h = 1, 2, 4: h of node 0's 4 ranks cross (0 -> 7; 0 -> 6, 1 -> 7; all)
    "one-peer-exp": ([1.0 * MS, 2.0 * MS, 4.0 * MS], 4),
    # across nodes (all 4 ranks to the other node), within (M over a rank link, hop 1), across,
    # within (hop 2): period 2 * lcm(1, 2) = 4
    "aer": ([4.0 * MS, 0.1 * MS, 4.0 * MS, 0.1 * MS], 4),
    # every rank to the 7 others: 4 x 4 flows over node 0's uplink
    "complete": ([16.0 * MS], 16),
    # node pair: ring All-Reduce of the 8 ranks, 2*7/8 M over the uplink (one ring flow);
    # then within nodes: 2*3/4 M / 1e10
    "aer-allreduce": ([1.75 * MS, 0.15 * MS], 1),
    # one group of all ranks: the ring All-Reduce, overlapping the whole iteration
    "complete-allreduce": ([1.75 * MS], 1),
}


@pytest.mark.parametrize("name", sorted(HAND))
def test_topology_exchange_hand_computed(name):
    times, flows = HAND[name]
    p = predict(two_tier(), M, 1 * MS, method=name)
    assert [x["seconds"] for x in p["steps"]] == [approx(t) for t in times]
    assert p["period"] == len(times)
    assert p["uplink_flows"] == flows
    assert p["comm_s"] == approx(sum(times) / len(times))
    # whole-iteration overlap, averaged over the period
    assert p["step_s"] == approx(sum(max(1 * MS, t) for t in times) / len(times))
    assert p["step_s"] == approx(
        predict(two_tier(), M, 1 * MS, method=name, overlap=False)["step_s"]
        - sum(min(1 * MS, t) for t in times) / len(times))


def test_flat_topologies_hand_computed():
    c = Cluster(1, 8, 8.0, 8.0, intra_latency_s=0.0)     # 1e9 B/s rank links
    m1 = M / 1e9
    assert predict(c, M, 0.0, method="ring")["comm_s"] == approx(2 * m1)
    assert predict(c, M, 0.0, method="torus")["comm_s"] == approx(3 * m1)   # 2 x 4: 3 peers
    assert predict(c, M, 0.0, method="exp")["comm_s"] == approx(3 * m1)     # log2 8 peers
    assert predict(c, M, 0.0, method="one-peer-exp")["comm_s"] == approx(m1)
    assert predict(c, M, 0.0, method="aer")["comm_s"] == approx(m1)  # one node: one-peer-exp
    assert predict(c, M, 0.0, method="complete")["comm_s"] == approx(7 * m1)
    assert predict(c, M, 0.0, method="complete-allreduce")["comm_s"] == approx(2 * 7 / 8 * m1)
    assert predict(c, M, 0.0, method="aer-allreduce")["comm_s"] == approx(2 * 7 / 8 * m1)


def test_topology_latency_terms():
    c = two_tier(intra_latency_s=1e-3, inter_latency_s=2e-3)
    # one round per neighbor exchange: inter latency once any flow crosses nodes
    ring = predict(c, 1, 0.0, method="ring")
    assert ring["steps"][0]["latency_s"] == approx(2e-3)
    aer = predict(c, 1, 0.0, method="aer")
    assert [x["latency_s"] for x in aer["steps"]] == [approx(2e-3), approx(1e-3)] * 2
    flat = predict(Cluster(1, 4, 8.0, 8.0, intra_latency_s=1e-3), 1, 0.0, method="exp")
    assert flat["steps"][0]["latency_s"] == approx(1e-3)
    # group averages: 2(g-1) rounds; node pair of 8 ranks, then nodes of 4
    groups = predict(c, 1, 0.0, method="aer-allreduce")
    assert [x["latency_s"] for x in groups["steps"]] == [approx(14 * 2e-3), approx(6 * 1e-3)]


def test_shared_uplink_arithmetic():
    c = two_tier()
    # every rank of node 0 sends M to its counterpart on node 1: 4 flows share the uplink
    x = model.transfer(c, [(r, r + 4, M) for r in range(4)])
    assert x["uplink_flows"] == 4 and x["seconds"] == approx(4 * M / 1e9)
    assert x["bottleneck"] in ("uplink-in 1", "uplink-out 0")
    # one flow alone gets the whole uplink
    assert model.transfer(c, [(0, 4, M)])["seconds"] == approx(M / 1e9)
    # an uplink 10x a rank link: the 2 flows are limited by their own rank links
    fast = two_tier(rpn=2, intra=8.0, inter=80.0)
    y = model.transfer(fast, [(0, 2, M), (1, 3, M)])
    assert y["seconds"] == approx(M / 1e9) and y["bottleneck"].startswith("rank")
    # two flows out of one rank share its link (intra) even if the uplink is idle
    z = model.transfer(c, [(0, 1, M), (0, 2, M)])
    assert z["seconds"] == approx(2 * M / 1e10) and z["uplink_flows"] == 0
    # loads are per direction (full duplex): 0 -> 4 and 4 -> 0 do not share
    assert model.transfer(c, [(0, 4, M), (4, 0, M)])["seconds"] == approx(M / 1e9)


def test_aer_periods_and_groups():
    assert Pattern("aer", 16, 4).period == 4        # 2 * lcm(log2 4 nodes, log2 4 ranks)
    assert Pattern("aer", 24, 4).period == 12       # 6 nodes: hops 1, 2, 4: 2 * lcm(3, 2)
    assert Pattern("aer", 4, 1).period == 2         # one rank per node: one-peer-exp of 4
    assert Pattern("aer", 4, 4).period == 2         # one node: the same
    assert Pattern("one-peer-exp", 8, 1).period == 3
    assert Pattern("one-peer-exp", 6, 1).out_peers(0, 1) == [4]   # sends to i - 2
    g = Pattern("aer-allreduce", 16, 4)             # 4 nodes: pairs at distance 1, then 2
    assert g.period == 4
    assert g.groups(0) == [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]
    assert g.groups(1) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert g.groups(2) == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]


@pytest.mark.parametrize("name", model.ALL_METHODS[1:])
@pytest.mark.parametrize("n,rpn", [(8, 4), (12, 3), (16, 4), (5, 1)])
def test_patterns_are_balanced(name, n, rpn):
    """Every rank sends to as many peers as read from it (W doubly stochastic in support)."""
    p = Pattern(name, n, rpn)
    for t in range(p.period):
        out = {r: p.out_peers(r, t) for r in range(n)}
        indeg = {r: sum(r in v for v in out.values()) for r in range(n)}
        assert all(len(out[r]) == indeg[r] for r in range(n)), (t, out)
        assert all(r not in out[r] for r in range(n))


def test_topology_object_as_method():
    """Any object with n, period and out_peers is exchanged point to point."""
    class Star:
        name, n, period = "star", 4, 1

        def out_peers(self, rank, step=0):
            return [1, 2, 3] if rank == 0 else [0]

    c = Cluster(1, 4, 8.0, 8.0, intra_latency_s=0.0)
    p = predict(c, M, 0.0, method=Star())
    assert p["method"] == "star" and p["comm_s"] == approx(3 * M / 1e9)
    with pytest.raises(ValueError):
        predict(Cluster(1, 2, 8.0, 8.0), M, 0.0, method=Star())


@pytest.mark.parametrize("n,rpn", [(8, 4), (16, 4), (12, 3), (6, 2), (8, 1), (5, 1), (32, 8)])
def test_model_patterns_are_the_library_topologies(n, rpn):
    """The model's copy of collectives.topology: same periods, same out-peers at every step."""
    topology = pytest.importorskip("collectives.topology")
    for name in model.TOPOLOGIES:
        lib = topology.by_name(name, n, **({"ranks_per_node": rpn} if name == "aer" else {}))
        ours = Pattern(name, n, rpn)
        assert ours.period == lib.period, name
        for t in range(2 * lib.period):
            assert [ours.out_peers(r, t) for r in range(n)] == \
                [lib.out_peers(r, t) for r in range(n)], (
                    f"{name} n={n} step {t}: tools.model.Pattern differs from "
                    f"collectives.topology: reconcile them (and docs/model.md)")
        # a Topology object is modeled exactly like its name
        c = two_tier(nodes=n // rpn, rpn=rpn)
        assert predict(c, M, 0.0, method=lib)["comm_s"] == approx(
            predict(c, M, 0.0, method=name)["comm_s"])


# ----------------------------------------------------------------------------- recommend

def test_recommend_order_and_ties():
    ranking = recommend(two_tier(), M, 1 * MS)
    # ring 2.0, allreduce 1/3 + 1.75, one-peer-exp (1 + 2 + 4)/3, aer (4 + 1 + 4 + 1)/4,
    # torus 4, exp 7, complete 16 (ms)
    assert [m for m, _ in ranking] == ["ring", "allreduce", "one-peer-exp", "aer", "torus",
                                       "exp", "complete"]
    assert [t for _, t in ranking] == [approx(x * MS) for x in
                                       (2.0, 1 / 3 + 1.75, 7 / 3, 2.5, 4.0, 7.0, 16.0)]
    # everything hidden behind a long compute: a tie, broken by mixing, All-Reduce first
    assert [m for m, _ in recommend(two_tier(), M, 1.0)] == list(
        m for m in model.TIE_ORDER if m in model.METHODS)
    assert recommend(two_tier(), M, 1 * MS, methods=["ring", "exp"]) == [
        ("ring", approx(2 * MS)), ("exp", approx(7 * MS))]
    # the group-average variants only when asked for
    with_groups = recommend(two_tier(), M, 1 * MS, methods=model.ALL_METHODS)
    assert with_groups[0] == ("aer-allreduce", approx(1.375 * MS))
    with pytest.raises(ValueError, match="unknown method"):
        recommend(two_tier(), M, 1 * MS, methods=["star"])


def test_recommend_whole_iteration_overlap_wins_on_slow_links():
    """One rank per host, 1 Gbit/s: the exchange hides behind the whole iteration."""
    c = Cluster(8, 1, 1.0, 1.0)
    t_ar = predict(c, 40 << 20, 0.6)["step_s"]
    best, t = recommend(c, 40 << 20, 0.6)[0]
    # aer with one rank per node is one-peer-exp: a tie, aer listed first
    assert best in ("aer", "one-peer-exp") and t == approx(0.6) and t_ar / t > 1.3


def test_shared_nic_aer_needs_group_averages():
    """The paper's setting (8 ranks per node, 25 Gbit/s between nodes): neighbor_allreduce's AER
    sends every rank's parameters over the uplink at the cross-node steps (8 flows), slower than
    All-Reduce; averaging node pairs by ring All-Reduce (Decent-DP) is faster than both."""
    c = Cluster(4, 8, 200.0, 25.0)
    p = {m: predict(c, 400 << 20, 0.25, method=m)["step_s"]
         for m in ("allreduce", "aer", "aer-allreduce")}
    assert predict(c, 400 << 20, 0.25, method="aer")["uplink_flows"] == 8
    assert p["aer"] > p["allreduce"] > p["aer-allreduce"]
    assert p["allreduce"] / p["aer-allreduce"] > 1.3


# ----------------------------------------------------------------------------- model CLI

def test_model_cli_json(capsys):
    rc = cli.main(["model", "--nodes", "2", "--ranks-per-node", "4", "--intra-gbit", "80",
                   "--inter-gbit", "8", "--intra-latency-us", "0", "--inter-latency-us", "0",
                   "--model-bytes", "1000000", "--compute-ms", "1", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cluster"]["n"] == 8 and out["model_bytes"] == M
    steps = [r["step_s"] for r in out["ranking"]]
    assert steps == sorted(steps)
    assert out["recommended"] == out["ranking"][0]["method"] == "ring"
    assert out["allreduce_step_s"] == approx((1 / 3 + 1.75) * MS)
    assert out["ranking"][0]["speedup"] == approx((1 / 3 + 1.75) / 2.0)
    assert set(out["predictions"]) == set(model.METHODS)
    assert out["measured"] is None


def test_model_cli_table_and_params(capsys):
    rc = cli.main(["model", "--nodes", "2", "--ranks-per-node", "4", "--intra-gbit", "100",
                   "--inter-gbit", "10", "--params", "25.6M", "--compute-ms", "120",
                   "--methods", "allreduce,aer,ring"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "97.66 MiB" in out          # 25.6e6 float32
    rows = [line.split()[0] for line in out.splitlines()
            if line.split() and line.split()[0] in model.METHODS]
    assert sorted(rows) == ["aer", "allreduce", "ring"] and "recommended: " in out
    rc = cli.main(["model", "--intra-gbit", "10", "--params", "1k", "--dtype", "float16",
                   "--compute-ms", "1", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["model_bytes"] == 2000


def test_model_cli_errors(capsys):
    assert cli.main(["model", "--intra-gbit", "10", "--compute-ms", "1"]) == 2
    assert "--model-bytes" in capsys.readouterr().err
    assert cli.main(["model", "--measure", "--intra-gbit", "10", "--model-bytes", "1M",
                     "--compute-ms", "1"]) == 2
    err = capsys.readouterr().err
    assert "--netlab" in err and "linerate bench" in err and "iperf3" in err
    assert cli.main(["model", "--nodes", "2", "--intra-gbit", "10", "--model-bytes", "1M",
                     "--compute-ms", "1"]) == 2
    assert "--inter-gbit" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["model", "--intra-gbit", "10", "--model-bytes", "1M", "--compute-ms", "1",
                  "--methods", "star"])


# ----------------------------------------------------------------------------- whatif

def test_buckets_by_size_and_cycle():
    mb = 1 << 20
    grads = [Grad("a", 1 * MS, 10 * mb), Grad("b", 2 * MS, 10 * mb), Grad("c", 3 * MS, 50 * mb),
             Grad("d", 9 * MS, 4 * mb), Grad("e", 10 * MS, 1 * mb)]
    assert make_buckets(grads, 64 * mb, None) == [Bucket(3 * MS, 70 * mb, 3),
                                                  Bucket(10 * MS, 5 * mb, 2)]
    assert make_buckets(grads, 64 * mb, 5 * MS) == [Bucket(3 * MS, 70 * mb, 3),
                                                    Bucket(9 * MS, 4 * mb, 1),
                                                    Bucket(10 * MS, 1 * mb, 1)]
    # ready order, not the order given
    assert make_buckets(list(reversed(grads)), 64 * mb, None)[0].ready_s == 3 * MS


def test_schedule_synthetic_timeline():
    """N = 2, B = 8 Gbit/s (1e9 B/s), t_add at 1e9 B/s: T_ar(S) = S/1e9 + (S/2)/1e9 = 1.5 S/1e9.
    Buckets 10 MB ready at 10 ms (15 ms), 2 MB at 20 ms (3 ms), 4 MB at 30 ms (6 ms); backward
    ends at 30 ms. 10->25, 25->28, 30->36: overhead 6 ms."""
    buckets = [Bucket(10 * MS, 10_000_000, 1), Bucket(20 * MS, 2_000_000, 1),
               Bucket(30 * MS, 4_000_000, 1)]
    t_add = AddCost(rate_bytes_s=1e9)
    s = schedule(buckets, 30 * MS, 2, 8e9, t_add)
    assert s["ends"] == [approx(25 * MS), approx(28 * MS), approx(36 * MS)]
    assert s["overhead_s"] == approx(6 * MS) and s["comm_s"] == approx(24 * MS)
    assert scaling_factor(100 * MS, s["overhead_s"]) == approx(100 / 106)
    # compression 2 halves the network term only: T_ar = S/1e9: 10->20, 20->22, 30->34
    s2 = schedule(buckets, 30 * MS, 2, 8e9, t_add, compression=2)
    assert s2["overhead_s"] == approx(4 * MS)
    # latency: + 2(N-1) * 1 ms per all-reduce: 10->27, 27->32, 32->40
    s3 = schedule(buckets, 30 * MS, 2, 8e9, t_add, latency_s=1 * MS)
    assert s3["overhead_s"] == approx(10 * MS)
    # finishing before backward ends is no overhead
    assert schedule([Bucket(1 * MS, 1000, 1)], 30 * MS, 2, 8e9, t_add)["overhead_s"] == 0.0
    # N ranks: (N-1) * t_add(S/N): N = 4, 4 MB, t_add 1e9 B/s: 1.5*4/1e9*... by hand:
    # 2*3/4*4e6/1e9 = 6 ms network + 3 * 1e6/1e9 = 3 ms adds
    assert whatif.allreduce_time(4_000_000, 4, 8e9, t_add) == approx(9 * MS)


def test_add_cost_interpolation():
    a = AddCost([(1000, 1e-6), (5000, 3e-6)])
    assert a(0) == 0.0 and a(10) == 1e-6            # fixed cost below the smallest size
    assert a(3000) == approx(2e-6)                  # linear in between
    assert a(10000) == approx(6e-6)                 # the largest size's time per byte
    assert AddCost(rate_bytes_s=float("inf"))(1e9) == 0.0


def test_scaling_factor_goes_to_one_with_bandwidth():
    grads = [Grad(f"g{i}", (i + 1) * MS, 4_000_000) for i in range(10)]
    buckets = make_buckets(grads, 16_000_000, None)
    tl = whatif.Timeline(grads, fwd_s=5 * MS, bwd_s=10 * MS)
    free = AddCost(rate_bytes_s=float("inf"))
    factors = [scaling_factor(tl.iter_s, schedule(buckets, tl.bwd_s, 64, gb * 1e9, free)
                              ["overhead_s"]) for gb in (1, 10, 100, 1e3, 1e4, 1e6)]
    assert factors == sorted(factors) and factors[0] < 0.2
    assert factors[-1] == approx(1.0, rel=1e-4)
    # with a reduction cost the limit is the adds alone, 63 * t_add(S / 64) at 1e9 B/s:
    # buckets of 16, 16, 8 MB ready at 4, 8, 10 ms take 15.75, 15.75, 7.875 ms back to back
    # from 4 ms: the last ends at 43.375 ms, 33.375 ms after backward
    slow = AddCost(rate_bytes_s=1e9)
    assert [b.ready_s for b in buckets] == [4 * MS, 8 * MS, 10 * MS]
    over = schedule(buckets, tl.bwd_s, 64, 1e21, slow)["overhead_s"]
    assert over == approx(33.375 * MS, rel=1e-6)


@pytest.mark.timeout(60)
def test_whatif_cli_mlp(capsys):
    rc = cli.main(["whatif", "--model", "mlp", "--batch", "8", "--iters", "1", "--warmup", "1",
                   "--gbit", "1,100", "--ranks", "2,16", "--compression", "1,4", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] > 1_000_000 and out["grad_bytes"] == 4 * out["params"]
    assert sum(b["nbytes"] for b in out["buckets"]) == out["grad_bytes"]
    ready = [g["ready_s"] for g in out["grads"]]
    assert ready == sorted(ready) and 0 < ready[-1] <= out["bwd_s"]
    res = {(r["compression"], r["ranks"], r["gbit"]): r for r in out["results"]}
    assert len(res) == 8
    for r in out["results"]:
        assert 0 < r["scaling_factor"] <= 1 and r["overhead_s"] >= 0
        assert r["scaling_factor"] == approx(out["iter_s"] / (out["iter_s"] + r["overhead_s"]))
    # faster links and compression never hurt
    for c in (1.0, 4.0):
        for n in (2, 16):
            assert res[c, n, 100.0]["scaling_factor"] >= res[c, n, 1.0]["scaling_factor"]
    assert res[4.0, 16, 1.0]["scaling_factor"] >= res[1.0, 16, 1.0]["scaling_factor"]


@pytest.mark.timeout(60)
def test_whatif_cli_table_user_model_and_plot(capsys, tmp_path, monkeypatch):
    (tmp_path / "mymodel.py").write_text(
        "import torch\n"
        "def make(batch):\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),\n"
        "                            torch.nn.Linear(128, 8))\n"
        "    return m, torch.randn(batch, 64)\n")
    monkeypatch.chdir(tmp_path)
    png = tmp_path / "w.png"
    rc = cli.main(["whatif", "--model", "mymodel:make", "--batch", "4", "--iters", "1",
                   "--gbit", "1,10", "--ranks", "2,4", "--add-gbs", "5", "--plot", str(png)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "compression 1x" in out and "t_add at 5 GB/s" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["2"], ["4"])]
    assert len(rows) == 2 and all(0 < float(x) <= 1 for row in rows for x in row[1:])
    pytest.importorskip("matplotlib")
    assert png.stat().st_size > 1000
    assert cli.main(["whatif", "--model", "nope"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_whatif_plot_without_matplotlib(monkeypatch, capsys):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert cli.main(["whatif", "--plot", "x.png"]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


# ----------------------------------------------------------------------------- netlab

def _netlab_reason():
    if not sys.platform.startswith("linux"):
        return "needs Linux"
    from tools import netlab
    return netlab.check_prereqs()


@pytest.mark.timeout(120)
def test_measure_netlab_two_tier(capsys):
    reason = _netlab_reason()
    if reason:
        pytest.skip(f"netlab unavailable: {reason}")
    from tools import netlab
    name = f"m{uuid.uuid4().hex[:8]}"
    try:
        netlab.up(name, hosts=4, rate="400mbit", nodes=2, inter_rate="100mbit")
        rc = cli.main(["model", "--netlab", name, "--measure", "--measure-seconds", "1.5",
                       "--model-bytes", "16M", "--compute-ms", "200", "--json"])
        assert rc == 0
        out = json.loads(capsys.readouterr().out)
    finally:
        netlab.down(name)
        assert netlab.lab_netns(name) == []
    c, m = out["cluster"], out["measured"]
    assert (c["nodes"], c["ranks_per_node"]) == (2, 2) and m["inter_flows"] == 2
    assert c["intra_gbit"] > c["inter_gbit"]
    assert c["intra_gbit"] == pytest.approx(0.4, rel=0.2), m
    assert c["inter_gbit"] == pytest.approx(0.1, rel=0.2), m
    assert 0 < c["intra_latency_s"] < 0.01 and 0 < c["inter_latency_s"] < 0.01
