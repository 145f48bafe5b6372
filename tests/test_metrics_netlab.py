"""The exported metrics tell the truth: on a netlab cluster at 1 Gbit/s, the bytes and the link
utilization that linerate exports agree with the interface's kernel counters
(/sys/class/net/IF/statistics, what node_exporter reads) within 3%.

Needs root and iproute2 (netlab); skipped with the reason elsewhere.
"""
from __future__ import annotations

import json
import textwrap

import pytest

from linerate.tools import netlab

needs_netlab = pytest.mark.netlab  # skipped with the reason where netlab cannot work (conftest)

# Each rank: all_reduce of 16 MB for RUN_S seconds. It reads the kernel counters of its own
# interface and scrapes its own /metrics endpoint at the start and the end (the byte check).
# For the utilization check it reads the kernel counters at every step of linerate's metrics
# sampler (an on_window callback, called right after the sampler read linerate's own
# counters), so each window's gauge can be held against the kernel's rate over that same
# window, and, in a thread, scrapes the gauge through the middle of the run, noting which
# window each scrape saw. (Comparing an average of gauges with the kernel over a span of its
# own is off by the rate's changes over up to one window: a loaded machine varies it.)
RANK = textwrap.dedent("""
    import json, os, sys, threading, time, urllib.request
    import torch
    import torch.distributed as dist
    from prometheus_client.parser import text_string_to_metric_families

    RUN_S = float(sys.argv[2])
    IF = os.environ["LINERATE_SOCKET_IFNAME"]

    def kernel():
        out = []
        for name in ("tx_bytes", "rx_bytes"):
            with open(f"/sys/class/net/{IF}/statistics/{name}") as f:
                out.append(int(f.read()))
        return out

    def scrape():
        port = int(os.environ["LINERATE_METRICS_PORT"])
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        out = {"tx": 0.0, "rx": 0.0, "util": {}, "cap": None}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.labels.get("interface") not in (IF, None):
                    continue
                if s.name == "linerate_sent_bytes_total":
                    out["tx"] += s.value
                elif s.name == "linerate_received_bytes_total":
                    out["rx"] += s.value
                elif s.name == "linerate_link_utilization_ratio":
                    out["util"][s.labels["direction"]] = s.value
                elif s.name == "linerate_link_capacity_bytes_per_second":
                    out["cap"] = s.value
        return out

    dist.init_process_group("linerate")
    from linerate.transport import metrics
    rank, world = dist.get_rank(), dist.get_world_size()
    windows = []  # [time, kernel tx, kernel rx] at each sampler step

    def on_window():
        windows.append([time.monotonic(), *kernel()])

    metrics.on_window(on_window)
    n = 4 << 20
    t = torch.ones(n)
    dist.all_reduce(t)
    samples = []  # [time before, time after, gauges] per scrape
    stop = threading.Event()

    def watch():
        t0 = time.monotonic()
        stop.wait(RUN_S * 0.3)
        while not stop.wait(0.25) and time.monotonic() - t0 < RUN_S * 0.9:
            before = time.monotonic()
            util = scrape()["util"]
            samples.append([before, time.monotonic(), util])

    k_start, e_start = kernel(), scrape()
    w = threading.Thread(target=watch)
    w.start()
    end = time.monotonic() + RUN_S
    iters = 0
    while True:  # every rank makes the same calls: the ranks agree when time is up
        t.fill_(rank + 1)
        dist.all_reduce(t)
        iters += 1
        go = torch.tensor([float(time.monotonic() < end)])
        dist.all_reduce(go, op=dist.ReduceOp.MIN)
        if go.item() == 0:
            break
    assert torch.all(t == world * (world + 1) / 2), t[:4]
    dist.barrier()
    k_end, e_end = kernel(), scrape()
    stop.set()
    w.join()
    res = {"rank": rank, "iters": iters, "cap": e_end["cap"],
           "kernel_tx": k_end[0] - k_start[0], "kernel_rx": k_end[1] - k_start[1],
           "exported_tx": e_end["tx"] - e_start["tx"], "exported_rx": e_end["rx"] - e_start["rx"],
           "samples": samples, "windows": list(windows)}
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()
""")


@needs_netlab
@pytest.mark.timeout(120)
def test_exported_bytes_and_utilization_match_kernel_counters(lab_name, tmp_path):
    run_s = 10.0
    lab = netlab.up(lab_name, hosts=2, rate="1gbit")
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {"LINERATE_METRICS_PORT": "19480", "LINERATE_METRICS_WINDOW": "2",
           "LINERATE_METRICS_ADDR": "127.0.0.1"}
    rc = netlab.run_ranks(lab, 2, [str(script), str(tmp_path), str(run_s)],
                          env={**__import__("os").environ, **env}, timeout=90)
    assert rc == 0
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["cap"] == pytest.approx(1e9 / 8), r
        for d in ("tx", "rx"):
            kernel, exported = r[f"kernel_{d}"], r[f"exported_{d}"]
            assert exported > 0.5e9, r  # the run moved real data (10 s at 1 Gbit/s ~ 1.2 GB)
            print(f"rank {rank} {d}: exported {exported / 1e6:.1f} MB, kernel {kernel / 1e6:.1f} MB "
                  f"({(exported - kernel) / kernel:+.2%})")
            assert abs(exported - kernel) / kernel < 0.03, (d, exported, kernel)
        # Utilization: each scraped gauge against the kernel's rate over the window it covers
        # (the sampler's steps k-1 to k, k the last step before the scrape began; a scrape
        # during which the sampler stepped is left out: either window may be the one it saw).
        steps = r["windows"]
        pairs = {"tx": [], "rx": []}
        for before, after, util in r["samples"]:
            k = sum(1 for w in steps if w[0] < before) - 1
            if k < 1 or any(before <= w[0] <= after for w in steps):
                continue
            (t0, tx0, rx0), (t1, tx1, rx1) = steps[k - 1], steps[k]
            for d, kbytes in (("tx", tx1 - tx0), ("rx", rx1 - rx0)):
                if d in util:
                    pairs[d].append((util[d], kbytes / (t1 - t0) / (1e9 / 8)))
        for d, seen in pairs.items():
            assert len(seen) >= 8, (d, r["samples"], steps)
            exported_util = sum(e for e, _ in seen) / len(seen)
            kernel_util = sum(k for _, k in seen) / len(seen)
            print(f"rank {rank} {d}: utilization exported {exported_util:.3f}, "
                  f"kernel {kernel_util:.3f} ({len(seen)} scrapes)")
            # The link carried the run's data in those windows (not an idle 0 against 0).
            assert kernel_util > 0.1, (d, seen)
            assert abs(exported_util - kernel_util) < 0.03 * kernel_util, (d, seen)
