"""`linerate model` (step-time model, recommendation) and `linerate whatif` (the what-if
analysis): formulas against hand-computed cases, the CLIs, and a netlab --measure run.

Hand-computed cases use round numbers: M = 1e6 bytes, 8 Gbit/s = 1e9 bytes/s,
80 Gbit/s = 1e10 bytes/s, latencies 0 unless the test is about latency.
"""
from __future__ import annotations

import json
import uuid

import pytest

from linerate.tools import cli, model
from linerate.tools.model import Cluster, Pattern, predict, recommend
from linerate.tools import whatif
from linerate.tools.whatif import AddCost, Bucket, Grad, make_buckets, schedule, scaling_factor

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


def test_overlap_off():
    c = two_tier()
    t_ar = 1.75 * MS
    assert predict(c, M, 3 * MS, overlap=False)["step_s"] == approx(3 * MS + t_ar)
    assert predict(c, M, 3 * MS, method="ring", overlap=False)["step_s"] == approx(
        3 * MS + 2 * MS)
    # fwd_fraction 1: nothing of the compute overlaps the All-Reduce
    assert predict(c, M, 3 * MS, fwd_fraction=1.0)["step_s"] == approx(3 * MS + t_ar)


# ----------------------------------------------------------------------------- CPU model
# Flat 8 ranks, rank links 8 Gbit/s (1e9 B/s), M = 1e6 B: ring T_net = 2*7/8 M / 1e9 = 1.75 ms,
# every ring edge carries 1.75e6 B (8 flows: 1.4e7 B in all); one-peer-exp sends 8 flows of M
# (8e6 B), T_net = 1 ms per step.

FLAT8 = Cluster(1, 8, 8.0, 8.0, intra_latency_s=0.0)


def cpu(cores, ranks, kappa=0.0, kappa_eff=None, **kw):
    return model.CpuModel(cores, ranks, model.CpuCosts(
        net_s_per_byte=kappa, shared_net_s_per_byte=kappa_eff, **kw))


def test_cpu_model_oversubscription():
    assert cpu(2, 8).oversubscription == 4 and cpu(2, 8).spare_cores == 0
    assert cpu(16, 8).oversubscription == 1 and cpu(16, 8).spare_cores == 8
    assert model.shared_compute_s(0.1, cpu(2, 8)) == approx(0.4)
    assert model.shared_compute_s(0.1, None) == 0.1
    with pytest.raises(ValueError):
        model.CpuModel(0, 8)
    with pytest.raises(ValueError):
        model.CpuCosts(net_s_per_byte=-1.0)


def test_cpu_costs_kappa_fallbacks():
    c = model.CpuCosts(net_s_per_byte=1e-9)
    assert c.kappa() == c.kappa(True) == c.kappa(False, True) == c.kappa(True, True) == 1e-9
    c = model.CpuCosts(net_s_per_byte=1e-9, inter_net_s_per_byte=2e-9,
                       shared_net_s_per_byte=3e-9)
    assert (c.kappa(), c.kappa(True), c.kappa(False, True)) == (1e-9, 2e-9, 3e-9)
    # across nodes beside compute, not measured: the within-node ratio (3x) applied
    assert c.kappa(True, True) == approx(6e-9)
    c.shared_inter_net_s_per_byte = 5e-9
    assert c.kappa(True, True) == 5e-9
    assert model.CpuCosts.from_json(c.to_json() | {"unknown": 1}) == c
    assert "kappa 1 ns/B" in c.describe() and "across nodes 2" in c.describe()


def test_comm_cpu_per_machine():
    flows = model.ring_flows(FLAT8, M)
    assert sum(b for _, _, b in flows) == approx(8 * 1.75 * M)
    # all 8 ranks on one machine pay for every byte; 4 per machine pay half
    assert model.comm_cpu_s(FLAT8, flows, cpu(2, 8, 1e-9)) == approx(1.4e-2)
    assert model.comm_cpu_s(FLAT8, flows, cpu(2, 4, 1e-9)) == approx(0.7e-2)
    assert model.comm_cpu_s(FLAT8, flows, cpu(2, 8, 1e-9, 2e-9), shared=True) == approx(2.8e-2)
    assert model.comm_cpu_s(FLAT8, flows, None) == 0.0
    # crossing flows pay the inter-node kappa: 2 of the 8 ring edges of 2 x 4 ranks cross
    c = two_tier()
    costs = model.CpuModel(2, 8, model.CpuCosts(net_s_per_byte=1e-9, inter_net_s_per_byte=3e-9))
    assert model.comm_cpu_s(c, model.ring_flows(c, M), costs) == approx(
        (6 * 1e-9 + 2 * 3e-9) * 1.75 * M)


def test_allreduce_oversubscribed_cores_do_not_overlap():
    # 8 ranks on 2 cores: C' = 4 C; the ring gets no spare core during backward
    p = predict(FLAT8, M, 1 * MS, method="allreduce", cpu=cpu(2, 8, 1e-10))
    assert p["shared_compute_s"] == approx(4 * MS) and p["overlap_share"] == 0.0
    # K = 1e-10 * 1.4e7 = 1.4e-3 core-s: K/P = 0.7 ms < T_net = 1.75 ms
    assert p["comm_s"] == approx(1.75 * MS) and p["step_s"] == approx(4 * MS + 1.75 * MS)
    # bytes that cost more: the cores are the limit of the All-Reduce alone, K/P = 7 ms
    q = predict(FLAT8, M, 1 * MS, method="allreduce", cpu=cpu(2, 8, 1e-9))
    assert q["comm_s"] == approx(7 * MS) and q["step_s"] == approx(11 * MS)
    # communication alone (compute 0): T_c
    assert predict(FLAT8, M, 0.0, cpu=cpu(2, 8, 1e-9))["step_s"] == approx(7 * MS)
    # DDP's three passes over the gradients: 3 * M * mem per rank, 8 ranks
    r = predict(FLAT8, M, 0.0, cpu=cpu(2, 8, 0.0, mem_s_per_byte=1e-9))
    assert r["comm_cpu_s"] == approx(3 * M * 1e-9 * 8)
    assert r["step_s"] == approx(max(1.75 * MS, 12 * MS))


def test_allreduce_spare_cores_overlap():
    # 16 cores for 8 ranks, cheap bytes: the classic T = T_fwd + max(T_bwd, T_ar)
    p = predict(FLAT8, M, 1 * MS, method="allreduce", cpu=cpu(16, 8, 1e-10))
    assert p["step_s"] == approx(1 / 3 * MS + 1.75 * MS)
    assert p["step_s"] == approx(predict(FLAT8, M, 1 * MS)["step_s"])
    # one spare core, K_eff = 1e-9 * 1.4e7 = 1.4e-2 core-s: during the 2/3 ms backward the
    # ring does 1/1.4e-2 per s * 2/3 ms = 4.76% of its work; T_c = max(1.75, 14/9) ms
    q = predict(FLAT8, M, 1 * MS, method="allreduce", cpu=cpu(9, 8, 1e-9))
    share = (2 / 3 * MS) / 1.4e-2
    assert q["overlap_share"] == approx(share)
    assert q["step_s"] == approx(1 * MS + (1 - share) * 1.75 * MS)
    # a long backward hides all of it
    assert predict(FLAT8, M, 30 * MS, cpu=cpu(16, 8, 1e-10))["step_s"] == approx(30 * MS)


def test_exchange_on_shared_cores():
    c2 = cpu(2, 8, 1e-10, 3e-10)
    # one-peer-exp: T_net 1 ms, K = 1e-10 * 8e6 = 0.8e-3, K_eff = 2.4e-3 core-s
    # C = 1 ms: the exchange is done while computing (s1 = 1): (8 * 1 ms + 2.4 ms) / 2
    p = predict(FLAT8, M, 1 * MS, method="one-peer-exp", cpu=c2)
    assert p["step_s"] == approx(5.2 * MS)
    assert [x["bound"] for x in p["steps"]] == ["cpu"] * 3
    assert [x["beside_share"] for x in p["steps"]] == [1.0] * 3
    # communication alone: max(T_net, K/P) with kappa, not kappa_eff
    assert predict(FLAT8, M, 0.0, method="one-peer-exp", cpu=c2)["step_s"] == approx(1 * MS)
    assert predict(FLAT8, M, 0.0, method="one-peer-exp",
                   cpu=cpu(2, 8, 1e-9))["step_s"] == approx(4 * MS)
    # C = 0.1 ms, K_eff = K = 0.8e-3 core-s: phase 1 runs until the compute is done,
    # D1 = (R C + s1 K_eff) / P with s1 = D1 / T_x:
    c3 = cpu(2, 8, 1e-10, 1e-10)
    # D1 = 0.4 / (1 - 0.8 / 2) = 2/3 ms, s1 = 2/3, T = 2/3 + 1/3 * 1 = 1 ms: network-bound
    q = predict(FLAT8, M, 0.1 * MS, method="one-peer-exp", cpu=c3)
    assert q["step_s"] == approx(1 * MS) and q["steps"][0]["beside_share"] == approx(2 / 3)
    # the exchange at half its pace while the ranks compute (phi = 0.5):
    # D1 = 0.4 / (1 - 0.5 * 0.8 / 2) = 0.5 ms, s1 = 0.25, T = 0.5 + 0.75 * 1 = 1.25 ms
    c4 = model.CpuModel(2, 8, model.CpuCosts(net_s_per_byte=1e-10, pace_beside_compute=0.5))
    r = predict(FLAT8, M, 0.1 * MS, method="one-peer-exp", cpu=c4)
    assert r["step_s"] == approx(1.25 * MS) and r["steps"][0]["beside_share"] == approx(0.25)
    # spare cores and cheap bytes: the classic max(C, T_net)
    assert predict(FLAT8, M, 3 * MS, method="one-peer-exp",
                   cpu=cpu(16, 8, 1e-12))["step_s"] == approx(3 * MS)
    # no overlap: C' + T_x
    assert predict(FLAT8, M, 1 * MS, method="one-peer-exp", cpu=c2,
                   overlap=False)["step_s"] == approx(5 * MS)
    # without CPU costs the model only shares the compute: max(T_net, C')
    assert predict(FLAT8, M, 1 * MS, method="ring", cpu=cpu(2, 8))["step_s"] == approx(4 * MS)


def test_measured_shared_compute():
    """C' measured (every rank computing at once) instead of rho * C."""
    c2 = cpu(2, 8, 1e-10, 3e-10)
    # DDP: C' + T_c = 5 + 1.75 ms instead of 4 + 1.75
    p = predict(FLAT8, M, 1 * MS, method="allreduce", cpu=c2, measured_shared_s=5 * MS)
    assert p["shared_compute_s"] == 5 * MS and p["step_s"] == approx(6.75 * MS)
    # exchange: the ranks' work is P C' = 10 ms of core time: (10 + 2.4) / 2
    q = predict(FLAT8, M, 1 * MS, method="one-peer-exp", cpu=c2, measured_shared_s=5 * MS)
    assert q["step_s"] == approx(6.2 * MS)
    # ignored without a CpuModel
    assert predict(FLAT8, M, 1 * MS, measured_shared_s=5 * MS)["step_s"] == approx(
        predict(FLAT8, M, 1 * MS)["step_s"])


def test_recommend_with_cpu_and_dec_compute():
    c2 = cpu(2, 8, 1e-10, 3e-10)
    ranking = dict(recommend(FLAT8, M, 1 * MS, methods=["allreduce", "one-peer-exp"],
                             cpu=c2, dec_compute_s=2 * MS))
    assert ranking["allreduce"] == approx(5.75 * MS)
    assert ranking["one-peer-exp"] == approx((16 + 2.4) / 2 * MS)


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
    # across nodes as aer; then each node's average point to point (no shared memory here):
    # every rank sends M to its 3 node peers over its rank link, 3e6 / 1e10
    "aer-average": ([4.0 * MS, 0.3 * MS], 4),
    # node average as a ring over rank links (2*3/4 M / 1e10 = 0.15 ms), 4 shards of M/4 over
    # the uplink (1 ms), the gather (0.15 ms)
    "hierarchical": ([1.3 * MS], 4),
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
    from linerate.collectives import topology
    for name in model.TOPOLOGIES + ("aer-average",):
        kw = ({"ranks_per_node": rpn} if name == "aer" else
              {"ranks_per_node": rpn, "intra": "average"} if name == "aer-average" else {})
        lib = topology.by_name("aer" if name == "aer-average" else name, n, **kw)
        ours = Pattern(name, n, rpn)
        assert ours.period == lib.period, name
        for t in range(2 * lib.period):
            assert [ours.out_peers(r, t) for r in range(n)] == \
                [lib.out_peers(r, t) for r in range(n)], (
                    f"{name} n={n} step {t}: tools.model.Pattern differs from "
                    f"collectives.topology: reconcile them (and docs/model.md)")
        # a Topology object is modeled exactly like its name
        for c in (two_tier(nodes=n // rpn, rpn=rpn),
                  two_tier(nodes=n // rpn, rpn=rpn, host_mem_gbs=10.0, shm_latency_s=1e-4)):
            assert predict(c, M, 0.0, method=lib)["comm_s"] == approx(
                predict(c, M, 0.0, method=name)["comm_s"]), (name, c)


# ----------------------------------------------------------------------------- two-level
# Hosts of ranks sharing memory: NIC 8 Gbit/s = 1e9 B/s, memory 10 GB/s = 1e10 B/s, a shared-memory
# operation 0.1 ms, inter-host latency 0.1 ms, M = 1e6 B.

MEM = model.IntraHost("memory", 1e10, 1e-4)


def test_intra_host_formulas():
    # memory: R*S/rate + latency per operation; links: the ring inside the host
    assert MEM.allreduce_s(M, 4) == approx(0.4 * MS + 0.1 * MS)
    assert MEM.allreduce_s(M, 4, ops=2) == approx(0.6 * MS)
    assert MEM.allreduce_s(M, 1) == 0.0 and MEM.allreduce_s(0, 4) == 0.0
    assert MEM.hop_bytes_s(4) == approx(2.5e9)
    links = model.IntraHost("links", 1e9, 1e-5)
    assert links.allreduce_s(M, 4) == approx(1.5 * MS + 6e-5)
    assert links.hop_bytes_s(4) == 1e9
    add = AddCost(rate_bytes_s=1e9)             # t_add(S) = S / 1e9
    assert MEM.allreduce_s(M, 4, add, compression=2.0) == approx(0.2 * MS + 3 * 0.25 * MS
                                                                 + 0.1 * MS)
    with pytest.raises(ValueError, match="kind"):
        model.IntraHost("nvlink", 1e9)


def test_two_level_and_flat_by_hand():
    # two-level on 2 hosts x 4: R*M/mem + 2 ops = 0.6 ms; across: 2(H-1)/H * M / NIC = 1 ms
    # plus 2(H-1) latencies = 0.2 ms: 1.8 ms
    two = model.two_level_allreduce(M, [4, 4], 1e9, MEM, 1e-4)
    assert two["intra_s"] == approx(0.6 * MS) and two["inter_s"] == approx(1.2 * MS)
    assert two["seconds"] == approx(1.8 * MS) and two["nic_bytes"] == approx(M)
    # flat ring over 8: 2*7/8 M at min(NIC, loopback 1e10) = 1.75 ms + 14 latencies = 1.4 ms
    loop = model.IntraHost("links", 1e10)
    flat = model.flat_ring_allreduce(M, [4, 4], 1e9, loop, 1e-4)
    assert flat["seconds"] == approx(3.15 * MS)
    both = model.allreduce_choice(M, [4, 4], 1e9, MEM, 1e-4)
    assert both["pick"] == "two-level" and both["seconds"] == approx(1.8 * MS)
    # uneven 4 + 3: the larger host sets the intra time (0.6 ms), the NIC still carries M;
    # flat: 2*6/7 M / 1e9 + 12 latencies
    assert model.two_level_allreduce(M, [4, 3], 1e9, MEM, 1e-4)["seconds"] == approx(1.8 * MS)
    assert model.flat_ring_allreduce(M, [4, 3], 1e9, loop, 1e-4)["seconds"] == approx(
        12 / 7 * MS + 1.2 * MS)
    # slow memory (1 GB/s): 4.2 + 1.2 ms two-level; the flat ring's hops in a host share it
    # too (1e9 / 4 each): 7 + 1.4 ms
    slow = model.IntraHost("memory", 1e9, 1e-4)
    both = model.allreduce_choice(M, [4, 4], 1e9, slow, 1e-4)
    assert both["two-level"]["seconds"] == approx(5.4 * MS)
    assert both["flat"]["seconds"] == approx(8.4 * MS) and both["pick"] == "two-level"
    # intra-host links as fast as the NIC, no latency: the flat ring moves fewer bytes per
    # NIC, 1.75 ms against 2*3/4 M / 1e9 + M / 1e9 = 2.5 ms
    both = model.allreduce_choice(M, [4, 4], 1e9, model.IntraHost("links", 1e9))
    assert both["flat"]["seconds"] == approx(1.75 * MS)
    assert both["two-level"]["seconds"] == approx(2.5 * MS) and both["pick"] == "flat"
    # one host: flat is the host's own All-Reduce (one operation), a tie goes to flat
    one = model.allreduce_choice(M, [4], 1e9, MEM)
    assert one["flat"]["seconds"] == approx(0.5 * MS) and one["pick"] == "flat"
    # one rank per host: both are the ring over the hosts' NICs
    assert model.two_level_allreduce(M, [1] * 4, 1e9, MEM)["seconds"] == approx(1.5 * MS)
    assert model.flat_ring_allreduce(M, [1] * 4, 1e9, MEM)["seconds"] == approx(1.5 * MS)
    with pytest.raises(ValueError, match="ranks per host"):
        model.two_level_allreduce(M, [4, 0], 1e9, MEM)
    # 4 pipelined chunks: t_i = 0.4/4 + 2 x 0.1 = 0.3 ms, t_e = 1/4 + 0.2 = 0.45 ms per chunk:
    # 0.3 + 0.45 + 3 x 0.45
    four = model.two_level_allreduce(M, [4, 4], 1e9, MEM, 1e-4, chunks=4)
    assert four["seconds"] == approx(2.1 * MS) and four["chunks"] == 4



def test_two_level_chunks_are_the_runtimes():
    """The model cuts the two-level all_reduce as collectives/two_level.py does: pieces of
    PIPE_BYTES, at most MAX_CHUNKS."""
    from linerate.collectives import two_level
    pipe, most = two_level.PIPE_BYTES, two_level.MAX_CHUNKS
    assert [model.two_level_chunks(b) for b in (1, pipe, 4 * pipe, 4 * most * pipe)] == [
        1, 1, 4, most]


def shm_cluster(layout=(4, 4), **kw):
    kw.setdefault("intra_latency_s", 0.0)
    kw.setdefault("inter_latency_s", 1e-4)
    return Cluster(len(layout), max(layout), 80.0, 8.0, host_mem_gbs=10.0, shm_latency_s=1e-4,
                   layout=layout, **kw)


def test_predict_picks_two_level_and_says_so():
    c = shm_cluster()
    assert c.even and c.layout is None and c.n == 8
    p = predict(c, M, 0.0)
    assert p["algorithm"] == "two-level" and p["comm_s"] == approx(1.8 * MS)
    assert p["algorithms"]["flat"]["allreduce_s"] == approx(3.15 * MS)  # ring_allreduce's
    assert "two-level picked: 1.80 ms against flat 3.15 ms" in p["formula"]
    # without shared memory there is nothing else to pick
    plain = predict(two_tier(), M, 0.0)
    assert plain["algorithm"] == "flat" and "algorithms" not in plain
    # uneven hosts: node_of and the flat ring follow the layout
    u = shm_cluster((4, 3))
    assert u.n == 7 and [u.node_of(r) for r in range(7)] == [0, 0, 0, 0, 1, 1, 1]
    pu = predict(u, M, 0.0)
    assert pu["algorithm"] == "two-level" and pu["comm_s"] == approx(1.8 * MS)
    assert pu["algorithms"]["flat"]["allreduce_s"] == approx(12 / 7 * MS + 1.2 * MS)
    with pytest.raises(ValueError, match="same ranks on every node"):
        predict(u, M, 0.0, method="aer")
    with pytest.raises(ValueError, match="layout"):
        Cluster(2, 3, 80.0, 8.0, layout=(4, 3))


def test_host_methods_on_shared_memory():
    c = shm_cluster()
    # aer-average: across hosts as aer (4 flows of M over the uplink + latency), then each
    # host's average on shared memory (4 M / 1e10 + 0.1 ms)
    p = predict(c, M, 0.0, method="aer-average")
    assert [x["seconds"] for x in p["steps"]] == [approx(4.1 * MS), approx(0.5 * MS)]
    assert p["steps"][1]["kind"] == "host averages"
    # the library's AER with 2 ranks per host: its intra-host steps are averages too
    c2 = shm_cluster((2, 2, 2, 2))
    aer = predict(c2, M, 0.0, method="aer")
    assert aer["steps"][1]["kind"] == "host averages"
    assert aer["steps"][1]["seconds"] == approx(2 * M / 1e10 + 1e-4)
    # hierarchical: average (0.5 ms), 4 shards of M/4 over the uplink (1 ms + 0.1 ms), the
    # gather in 4 broadcasts (4 M / 1e10 + 4 x 0.1 ms)
    h = predict(c, M, 0.0, method="hierarchical")
    assert h["comm_s"] == approx(0.5 * MS + 1.1 * MS + 0.8 * MS) and h["period"] == 1
    # uneven: K = 3 shards of M/3, the 4-rank host sets the intra-host times
    hu = predict(shm_cluster((4, 3)), M, 0.0, method="hierarchical")
    assert hu["comm_s"] == approx(0.5 * MS + 1.1 * MS + (0.4 + 0.3) * MS)
    # CPU: the shared-memory passes cost memory time, the shards kappa
    cpu_m = model.CpuModel(2, 8, model.CpuCosts(net_s_per_byte=1e-9, mem_s_per_byte=1e-10))
    x = predict(c, M, 0.0, method="hierarchical", cpu=cpu_m)["steps"][0]
    assert x["comm_cpu_s"] == approx(2 * M * 1e-9 + 4 * 8 * M * 1e-10)


def test_model_cli_shared_memory_hosts(capsys):
    base = ["model", "--intra-gbit", "80", "--inter-gbit", "8", "--host-mem-gbs", "10",
            "--shm-latency-us", "100", "--intra-latency-us", "0", "--inter-latency-us", "100",
            "--model-bytes", "1000000", "--compute-ms", "0"]
    assert cli.main([*base, "--nodes", "2", "--ranks-per-node", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"aer-average", "hierarchical"} <= set(out["predictions"])
    assert out["predictions"]["allreduce"]["algorithm"] == "two-level"
    assert out["cluster"]["host_mem_gbs"] == 10.0
    assert cli.main([*base, "--ranks-per-node", "4,3"]) == 0
    text = capsys.readouterr().out
    assert "All-Reduce: flat 2.91 ms (step 2.91 ms), two-level 1.80 ms" in text
    assert "-> two-level, the faster" in text and "allreduce (two-level)" in text
    assert "not ranked on uneven nodes" in text and "4+3 (n=7)" in text
    assert cli.main([*base, "--nodes", "3", "--ranks-per-node", "4,3"]) == 2
    assert "names 2 nodes" in capsys.readouterr().err
    assert cli.main(["model", "--intra-gbit", "8", "--shm-latency-us", "5", "--model-bytes",
                     "1M", "--compute-ms", "1"]) == 2
    assert "needs --host-mem-gbs" in capsys.readouterr().err


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
    with_groups = recommend(two_tier(), M, 1 * MS,
                            methods=model.METHODS + model.GROUP_METHODS)
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


def test_model_cli_cpu(capsys, tmp_path):
    base = ["model", "--nodes", "1", "--ranks-per-node", "8", "--intra-gbit", "8",
            "--intra-latency-us", "0", "--model-bytes", "1000000", "--compute-ms", "1",
            "--methods", "allreduce,one-peer-exp"]
    rc = cli.main(base + ["--cores", "2", "--ranks-per-machine", "8", "--kappa-ns", "0.1",
                          "--kappa-eff-ns", "0.3", "--dec-compute-ms", "2", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cpu"] == {"cores": 2.0, "ranks": 8, "rho": 4.0}
    assert out["cpu_costs"]["net_s_per_byte"] == approx(1e-10)
    steps = {r["method"]: r["step_s"] for r in out["ranking"]}
    assert steps["allreduce"] == approx(5.75 * MS)
    assert steps["one-peer-exp"] == approx((16 + 2.4) / 2 * MS)
    assert out["ranking"][0]["method"] == "allreduce"
    assert [r["bound"] for r in out["ranking"]] == ["network", "cpu"]
    # the same costs from a file (the JSON of a --measure-cpu --json run)
    f = tmp_path / "costs.json"
    f.write_text(json.dumps({"cpu_costs": out["cpu_costs"]}))
    rc = cli.main(base + ["--cores", "2", "--ranks-per-machine", "8", "--cpu-costs", str(f),
                          "--dec-compute-ms", "2"])
    assert rc == 0
    table = capsys.readouterr().out
    assert "# cpu: 8 rank(s) on 2 core(s) (rho 4)" in table and "decentralized 2.00 ms" in table
    assert "5.75" in table
    # the compute of all ranks at once, measured, instead of rho * C
    rc = cli.main(base + ["--cores", "2", "--kappa-ns", "0.1", "--kappa-eff-ns", "0.3",
                          "--shared-compute-ms", "5", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert {r["method"]: r["step_s"] for r in out["ranking"]} == {
        "allreduce": approx(6.75 * MS), "one-peer-exp": approx(6.2 * MS)}
    # the CPU model needs cores
    assert cli.main(base + ["--kappa-ns", "1"]) == 2
    assert "--cores" in capsys.readouterr().err


@pytest.mark.processes  # model.measure_cpu_costs starts its rank processes
@pytest.mark.timeout(180)
def test_measure_cpu_costs_loopback():
    """Two linerate ranks over loopback: the exchange alone, the compute alone, both."""
    costs = model.measure_cpu_costs(None, seconds=0.3, ranks=2, cores=2, cycles=1)
    raw = costs.raw
    assert raw["where"] == "loopback, 2 ranks" and raw["probe"]["ranks"] == 2
    assert 0 < costs.net_s_per_byte < 1e-7, raw
    assert costs.shared_net_s_per_byte is not None and costs.shared_net_s_per_byte >= 0
    assert 0 < costs.pace_beside_compute <= 1
    cycle = raw["probe"]["cycles"][0]
    assert cycle["compute_rate_alone"] > 0 and cycle["exchange_alone_s"] > 0
    assert 0 < costs.mem_s_per_byte < 1e-8
    assert costs.inter_net_s_per_byte is None


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


@pytest.mark.processes  # matplotlib's first use on a machine runs fc-list for its font cache
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
    assert png.stat().st_size > 1000  # matplotlib: the test extra
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

@pytest.mark.netlab  # alone on its worker (tests/conftest.py): it measures bandwidth
@pytest.mark.timeout(240)
def test_measure_netlab_two_tier(capsys):
    """--measure on netlab: the links, and (the CPU model is on with --netlab) the CPU costs
    with a rank on every host."""
    from linerate.tools import netlab
    name = f"m{uuid.uuid4().hex[:8]}"
    try:
        netlab.up(name, hosts=4, rate="400mbit", nodes=2, inter_rate="200mbit")
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
    assert c["inter_gbit"] == pytest.approx(0.2, rel=0.2), m
    assert 0 < c["intra_latency_s"] < 0.01 and 0 < c["inter_latency_s"] < 0.01
    import os
    assert out["cpu"]["ranks"] == 4 and out["cpu"]["cores"] == os.cpu_count()
    costs = out["cpu_costs"]
    assert costs["raw"]["where"].endswith("4 ranks") and 0 < costs["net_s_per_byte"] < 1e-7
    assert 0 < costs["pace_beside_compute"] <= 1 and costs["shared_net_s_per_byte"] >= 0


@pytest.mark.netlab  # alone on its worker (tests/conftest.py): it measures bandwidth
def test_measure_netlab_ranks_per_host(capsys):
    """--measure on a lab of 2 hosts x 2 ranks: the host link, loopback, latencies and every
    host's shared-memory All-Reduce at once; the model then picks between flat and two-level.
    Without --measure the lab needs --host-mem-gbs."""
    from linerate.tools import netlab
    name = f"m{uuid.uuid4().hex[:8]}"
    try:
        netlab.up(name, hosts=2, rate="400mbit", ranks_per_host=2)
        base = ["model", "--netlab", name, "--model-bytes", "4M", "--compute-ms", "0",
                "--no-cpu"]
        assert cli.main(base) == 2
        assert "--host-mem-gbs" in capsys.readouterr().err
        assert cli.main([*base, "--host-mem-gbs", "5", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["cluster"]["host_mem_gbs"] == 5 and out["cluster"]["inter_gbit"] == 0.4
        rc = cli.main([*base, "--measure", "--measure-seconds", "0.5", "--json"])
        assert rc == 0
        out = json.loads(capsys.readouterr().out)
    finally:
        netlab.down(name)
        assert netlab.lab_netns(name) == []
    c, m = out["cluster"], out["measured"]
    assert (c["nodes"], c["ranks_per_node"]) == (2, 2) and m["ranks_per_host"] == [2, 2]
    assert c["inter_gbit"] == pytest.approx(0.4, rel=0.2), m
    assert c["intra_gbit"] > c["inter_gbit"] and c["host_mem_gbs"] > 0.1, m
    assert [h["ranks"] for h in m["shm"]["hosts"]] == [2, 2] and m["shm"]["bytes"] == 4 << 20
    assert 0 < c["shm_latency_s"] < 0.1 and 0 < c["inter_latency_s"] < 0.01
    ar = out["predictions"]["allreduce"]
    # which wins depends on the measured shared memory (slow on a loaded machine): the faster
    assert set(ar["algorithms"]) == {"flat", "two-level"}
    assert ar["algorithm"] == min(ar["algorithms"], key=lambda k: ar["algorithms"][k]["step_s"])
    assert {"aer-average", "hierarchical"} <= set(out["predictions"])


def test_cluster_from_an_unshaped_lab_asks_for_a_measurement():
    from linerate.tools import netlab
    shaped = model.cluster_from_lab(netlab.plan("m1", 4, 1, 10**9, nodes=2, inter_rate_bps=4 * 10**8))
    assert (shaped.nodes, shaped.ranks_per_node, shaped.intra_gbit, shaped.inter_gbit) == (2, 2, 1.0, 0.4)
    for lab, flag in ((netlab.plan("m2", 4, 1, 0), "--rate none"),
                      (netlab.plan("m3", 4, 1, 10**9, nodes=2, inter_rate_bps=0), "--inter-rate none")):
        with pytest.raises(ValueError, match=f"unshaped \\({flag}\\).*--measure"):
            model.cluster_from_lab(lab)
