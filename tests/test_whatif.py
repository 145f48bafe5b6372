"""`linerate whatif` from a recorded timeline: the paper simulator's bk.log, whatif's own --json
output and a torch.profiler trace; --add-cost tables; hosts of several GPUs (flat ring against
two-level all-reduce); bad input named by file and line. The timelines of these tests are
written by the tests themselves, except the check against the paper's simulator (at the end):
it replays the paper's own logs, shipped in tests/data/training-bottleneck/ (Apache-2.0, see
the README and LICENSE there)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from pytest import approx

from linerate.tools import cli, whatif
from linerate.tools.whatif import AddCost, TimelineError

MS = 1e-3
# 8 Gbit/s links and t_add(S) = S / 1e9: at N = 2, T_ar(S) = S/1e9 + (S/2)/1e9 = 1.5 S / 1e9
ADD_TABLE = "# bytes,seconds: t_add(S) = S / 1e9 in between\n1000000,0.001\n100000000,0.1\n"
BK_LOG = ("first line is for explanation; batches; layers; wait_us,bytes\n1\n3\n"
          "10000,10000000\n10000,2000000\n10000,4000000\n")


def _write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _whatif_json(capsys, argv: list[str]) -> dict:
    assert cli.main(["whatif", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _error(capsys, argv: list[str]) -> str:
    assert cli.main(["whatif", *argv]) == 2
    return capsys.readouterr().err


# ----------------------------------------------------------------------------- bk.log

def test_bk_log_read(tmp_path):
    tl = whatif.load_bk_log(_write(tmp_path, "m.bk.log", BK_LOG))
    assert [(g.ready_s, g.nbytes) for g in tl.grads] == [
        (approx(10 * MS), 10_000_000), (approx(20 * MS), 2_000_000),
        (approx(30 * MS), 4_000_000)]
    assert tl.bwd_s == approx(30 * MS) and tl.fwd_s is None and tl.iter_s is None
    assert tl.params == 4_000_000
    # two batches: the mean wait of each layer; zero waits keep the backward order
    two = whatif.load_bk_log(_write(tmp_path, "two.bk.log",
                                    "c\n2\n3\n1000,8\n0,4\n3000,4\n3000,8\n0,4\n1000,4\n"))
    assert [(g.name, g.ready_s) for g in two.grads] == [
        ("layer0", approx(2 * MS)), ("layer1", approx(2 * MS)), ("layer2", approx(4 * MS))]


def test_bk_log_schedule_by_hand(tmp_path, capsys):
    """Buckets closed by the 5 ms cycle at 10, 20, 30 ms (10, 2, 4 MB); N = 2 at 8 Gbit/s with
    t_add(S) = S/1e9 from the table: T_ar = 1.5 S/1e9 = 15, 3, 6 ms; 10->25, 25->28, 30->36:
    overhead 6 ms; with --iter-ms 100 the scaling factor is 100/106."""
    out = _whatif_json(capsys, ["--timeline", _write(tmp_path, "m.bk.log", BK_LOG),
                                "--add-cost", _write(tmp_path, "add.log", ADD_TABLE),
                                "--iter-ms", "100", "--ranks", "2", "--gbit", "8",
                                "--compression", "1,2"])
    assert out["timeline"] == {"file": str(tmp_path / "m.bk.log"), "format": "bk.log"}
    assert out["iter_s"] == approx(0.1) and out["bwd_s"] == approx(30 * MS)
    assert out["fwd_s"] is None and out["opt_s"] is None
    assert out["t_add"]["source"] == "add.log"
    assert [b["nbytes"] for b in out["buckets"]] == [10_000_000, 2_000_000, 4_000_000]
    r1, r2 = out["results"]
    assert (r1["compression"], r1["ranks"], r1["gbit"], r1["algorithm"]) == (1, 2, 8, "ring")
    assert r1["overhead_s"] == approx(6 * MS) and r1["comm_s"] == approx(24 * MS)
    assert r1["scaling_factor"] == approx(100 / 106)
    # compression 2 halves the network term only: T_ar = S/1e9: 10->20, 20->22, 30->34
    assert r2["overhead_s"] == approx(4 * MS) and r2["scaling_factor"] == approx(100 / 104)
    # the table and its header
    assert cli.main(["whatif", "--timeline", str(tmp_path / "m.bk.log"), "--add-gbs", "1",
                     "--iter-ms", "100", "--ranks", "2,4", "--gbit", "8,100"]) == 0
    text = capsys.readouterr().out
    assert "timeline from the paper simulator's log" in text and "100.0 ms (--iter-ms)" in text
    assert "backward 30.0" in text and "forward" not in text


def test_bk_log_needs_iteration_time(tmp_path, capsys):
    err = _error(capsys, ["--timeline", _write(tmp_path, "m.bk.log", BK_LOG), "--add-gbs", "1"])
    assert "m.bk.log gives no iteration time" in err and "--iter-ms" in err


# ----------------------------------------------------------------------------- add cost

def test_add_cost_table_interpolation(tmp_path):
    a = AddCost.from_file(_write(tmp_path, "add.log", "4000,2e-6\n1000,1e-6\n\n# x\n"))
    assert a.points == [(1000, 1e-6), (4000, 2e-6)] and a.source == "add.log"
    assert a(0) == 0.0 and a(10) == 1e-6            # below the smallest size: its time
    assert a(2500) == approx(1.5e-6)                # linear in between, as numpy.interp
    assert a(8000) == approx(4e-6)                  # above the largest: its time per byte
    assert "add.log, 2 sizes, interpolated" in a.describe()
    assert AddCost.from_dict(a.to_dict()).points == a.points
    assert AddCost.from_dict(AddCost(rate_bytes_s=float("inf")).to_dict())(1e9) == 0.0


def test_add_cost_table_matches_numpy_interp(tmp_path):
    import numpy as np  # a dependency of linerate
    xs = [40, 1000, 65536, 1 << 20, 1 << 24]
    ts = [9e-6, 8e-6, 1.1e-5, 2e-5, 3e-4]
    a = AddCost.from_file(_write(tmp_path, "add.log",
                                 "".join(f"{x},{t}\n" for x, t in zip(xs, ts))))
    for s in (1, 40, 500, 40000, 300000, 5e6, 1 << 24):
        assert a(s) == approx(float(np.interp(s, xs, ts)), rel=1e-12)


@pytest.mark.parametrize("text, line, what", [
    ("1000,1e-6\n2000\n", 2, "expected 'bytes,seconds'"),
    ("1000,1e-6\nabc,1\n", 2, "expected 'bytes,seconds'"),
    ("1000,1e-6\n2000,-1\n", 2, "not negative"),
    ("1000,1e-6\n1000,2e-6\n", 2, "given twice (also on line 1)"),
    ("# nothing\n", 1, "no 'bytes,seconds' lines"),
])
def test_add_cost_bad_input(tmp_path, text, line, what):
    path = _write(tmp_path, "add.log", text)
    with pytest.raises(TimelineError) as e:
        AddCost.from_file(path)
    assert f"{path}:{line}:" in str(e.value) and what in str(e.value)


# ----------------------------------------------------------------------------- own JSON

def test_own_json_round_trip(tmp_path, capsys, monkeypatch):
    """whatif --json output read back with --timeline gives the same results, with the t_add
    it carries (a profile taken on a GPU is analysed anywhere with that GPU's t_add)."""
    grid = ["--ranks", "2,8", "--gbit", "1,8", "--compression", "1,4"]
    first = _whatif_json(capsys, ["--timeline", _write(tmp_path, "m.bk.log", BK_LOG),
                                  "--add-cost", _write(tmp_path, "add.log", ADD_TABLE),
                                  "--iter-ms", "100", *grid])
    saved = _write(tmp_path, "WHATIF.json", json.dumps(first))
    monkeypatch.setattr(whatif, "measure_add", lambda *a, **k: pytest.fail("re-measured"))
    again = _whatif_json(capsys, ["--timeline", saved, *grid])
    assert again["results"] == first["results"]
    assert again["t_add"] == first["t_add"] and again["iter_s"] == first["iter_s"]
    assert again["timeline"]["format"] == "whatif-json"
    # the reproduce command in the output is that same command line
    cmd = first["reproduce"].split()
    assert cmd[:4] == ["linerate", "whatif", "--timeline", "WHATIF.json"]
    monkeypatch.chdir(tmp_path)
    assert _whatif_json(capsys, cmd[2:-1])["results"] == first["results"]
    # every input of the result is in the output
    for key in ("gbit", "ranks", "compression", "gpus_per_host", "intra_gbit", "bucket_bytes",
                "cycle_ms", "latency_s", "t_add", "grads", "iter_s", "bwd_s"):
        assert key in first
    # --iter-ms replaces the file's iteration time
    assert _whatif_json(capsys, ["--timeline", saved, "--iter-ms", "50", *grid])[
        "iter_s"] == approx(0.05)


@pytest.mark.timeout(60)
def test_profiled_json_read_back(tmp_path, capsys):
    out = _whatif_json(capsys, ["--model", "mlp", "--batch", "4", "--iters", "1",
                                "--ranks", "2,4", "--gbit", "1,10"])
    assert out["device"] == "cpu" and out["timeline"]["format"] == "profiled"
    again = _whatif_json(capsys, ["--timeline", _write(tmp_path, "p.json", json.dumps(out)),
                                  "--ranks", "2,4", "--gbit", "1,10"])
    assert again["results"] == out["results"]
    assert again["fwd_s"] == out["fwd_s"] and again["opt_s"] == out["opt_s"]


# ----------------------------------------------------------------------------- torch.profiler

def _profile_steps(path: str, record_shapes: bool = True) -> list[int]:
    """Profile 2 training steps (after 1 of warm-up) of a small CPU model; returns the
    parameters' sizes in bytes."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=record_shapes,
                 schedule=schedule(wait=0, warmup=1, active=2, repeat=1)) as prof:
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            prof.step()
    prof.export_chrome_trace(path)
    return [p.numel() * p.element_size() for p in model.parameters()]


@pytest.mark.timeout(120)
def test_torch_profiler_trace(tmp_path, capsys):
    path = str(tmp_path / "trace.json")
    sizes = _profile_steps(path)
    tl, meta = whatif.load_timeline(path)
    assert meta == {"steps": 2, "device": "cpu", "format": "torch-profiler"}
    assert sorted(g.nbytes for g in tl.grads) == sorted(sizes)
    ready = [g.ready_s for g in tl.grads]
    assert ready == sorted(ready) and 0 < ready[0] and ready[-1] <= tl.bwd_s
    assert tl.fwd_s > 0 and tl.opt_s > 0 and tl.iter_s == approx(tl.fwd_s + tl.bwd_s + tl.opt_s)
    assert tl.iter_s < 5.0                          # seconds, not microseconds
    # the last layer's gradients are ready first (backward order)
    assert tl.grads[0].nbytes in (10 * 4, 256 * 10 * 4)
    out = _whatif_json(capsys, ["--timeline", path, "--add-gbs", "10", "--ranks", "2,16",
                                "--gbit", "1,100"])
    assert out["grad_bytes"] == sum(sizes) and len(out["results"]) == 4
    assert out["timeline"]["format"] == "torch-profiler"
    assert all(0 < r["scaling_factor"] <= 1 for r in out["results"])


@pytest.mark.timeout(120)
def test_torch_profiler_trace_without_shapes(tmp_path, capsys):
    path = str(tmp_path / "trace.json")
    _profile_steps(path, record_shapes=False)
    err = _error(capsys, ["--timeline", path, "--add-gbs", "1"])
    assert path in err and "record_shapes=True" in err


def _x(name, ts, dur, cat="cpu_op", **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1,
            "args": args}


def test_gpu_trace_ready_when_the_device_is_done(tmp_path):
    """A hand-made trace of one CUDA step (microseconds). The host launches kernels ahead of
    the device: a gradient is ready when the kernels launched before its AccumulateGrad have
    finished, as a CUDA event recorded there would complete."""
    acc = "torch::autograd::AccumulateGrad"
    ev = [_x("ProfilerStep#3", 0, 1000, cat="user_annotation"),
          _x("cudaLaunchKernel", 10, 2, cat="cuda_runtime", correlation=1),
          _x("fwd_kernel", 20, 130, cat="kernel", correlation=1),            # 20..150
          _x("autograd::engine::evaluate_function: MulBackward0", 100, 20),
          _x("cudaLaunchKernel", 105, 2, cat="cuda_runtime", correlation=2),
          _x("mul_bwd_kernel", 160, 240, cat="kernel", correlation=2),       # 160..400
          _x("autograd::engine::evaluate_function: " + acc, 125, 5),
          _x(acc, 126, 3, **{"Input Dims": [[10, 10]], "Input type": ["float"]}),
          _x("autograd::engine::evaluate_function: AddBackward0", 140, 16),
          _x("cudaLaunchKernel", 142, 2, cat="cuda_runtime", correlation=3),
          _x("add_bwd_kernel", 400, 50, cat="kernel", correlation=3),        # 400..450
          _x(acc, 152, 2, **{"Input Dims": [[5]], "Input type": ["c10::Half"]}),
          _x("cudaLaunchKernel", 160, 2, cat="cuda_runtime", correlation=4),
          _x("sgd_kernel", 450, 150, cat="kernel", correlation=4)]           # 450..600
    path = _write(tmp_path, "gpu.json", json.dumps({"traceEvents": ev}))
    tl, meta = whatif.load_timeline(path)
    assert meta["device"] == "cuda" and meta["steps"] == 1
    # the same events as a bare JSON array (Chrome's other trace form)
    bare, _ = whatif.load_timeline(_write(tmp_path, "bare.json", json.dumps(ev)))
    assert bare == tl
    # backward starts when the forward's kernels end (150), not at 100 on the host
    assert tl.fwd_s == approx(150e-6)
    assert [(g.name, g.ready_s, g.nbytes) for g in tl.grads] == [
        ("grad0[10x10]", approx(250e-6), 400), ("grad1[5]", approx(300e-6), 10)]
    assert tl.bwd_s == approx(300e-6) and tl.opt_s == approx(550e-6)
    assert tl.iter_s == approx(1000e-6)


# ----------------------------------------------------------------------------- hosts of GPUs

def test_flat_and_two_level_by_hand():
    """16 ranks in 2 hosts of 8, S = 8 MB, no reduction cost. NIC 10 Gbit/s (1.25e9 B/s).
    Flat ring: 2*15/16 * S over min(NIC, intra) per step. Two-level: 2*7/8 * S / intra +
    2*1/2 * S / NIC (8 rings of S/8 share the NIC)."""
    free = AddCost(rate_bytes_s=float("inf"))
    s, nic = 8e6, 10e9
    flat = whatif.flat_ring_time(s, 16, 8, nic, 100e9, free)
    two = whatif.two_level_time(s, 16, 8, nic, 100e9, free)
    assert flat == approx(1.875 * s / 1.25e9)                      # 12 ms
    assert two == approx(1.75 * s / 12.5e9 + s / 1.25e9)           # 1.12 + 6.4 ms
    # intra as slow as the NIC: the flat ring moves fewer bytes
    assert whatif.flat_ring_time(s, 16, 8, nic, nic, free) == approx(12e-3)
    assert whatif.two_level_time(s, 16, 8, nic, nic, free) == approx(17.6e-3)
    # the reduction cost: (P-1) t_add(S/P) flat, (G-1) t_add(S/G) + (H-1) t_add(S/P) two-level
    add = AddCost(rate_bytes_s=1e9)
    assert whatif.flat_ring_time(s, 16, 8, 1e30, 1e30, add) == approx(15 * s / 16 / 1e9)
    assert whatif.two_level_time(s, 16, 8, 1e30, 1e30, add) == approx(
        (7 * s / 8 + s / 16) / 1e9)
    # latency: 2(P-1) steps flat, 2(G-1) + 2(H-1) two-level
    assert whatif.two_level_time(s, 16, 8, 1e30, 1e30, free, latency_s=1e-6) == approx(16e-6)
    assert whatif.flat_ring_time(s, 16, 8, 1e30, 1e30, free, latency_s=1e-6) == approx(30e-6)
    # one GPU per host: both are the paper's ring; one host: both run on intra-host links
    assert whatif.flat_ring_time(s, 16, 1, nic, 1.0, free) == approx(
        whatif.allreduce_time(s, 16, nic, free))
    assert whatif.two_level_time(s, 16, 1, nic, 1.0, free) == approx(
        whatif.allreduce_time(s, 16, nic, free))
    assert whatif.flat_ring_time(s, 4, 8, 1.0, 100e9, free) == approx(
        whatif.two_level_time(s, 4, 8, 1.0, 100e9, free)) == approx(1.5 * s / 12.5e9)


def test_whatif_and_model_share_the_formulas(monkeypatch):
    """whatif's flat and two-level times are linerate.tools.model's functions (hosts of G ranks
    on rank links of --intra-gbit): one implementation for both tools. Same case as above: S =
    8 MB on 2 hosts of 8, NIC 1.25e9 B/s, intra 12.5e9 B/s, latency 1 us per step."""
    from linerate.tools import model
    free = AddCost(rate_bytes_s=float("inf"))
    s = 8e6
    intra = model.IntraHost("links", 12.5e9, 1e-6)
    two = model.two_level_allreduce(s, [8, 8], 1.25e9, intra, 1e-6, free)
    assert two["intra_s"] == approx(1.75 * s / 12.5e9 + 14e-6)
    assert two["inter_s"] == approx(s / 1.25e9 + 2e-6)
    assert whatif.two_level_time(s, 16, 8, 10e9, 100e9, free, latency_s=1e-6) == approx(
        two["seconds"])
    assert whatif.flat_ring_time(s, 16, 8, 10e9, 100e9, free, latency_s=1e-6) == approx(
        model.flat_ring_allreduce(s, [8, 8], 1.25e9, intra, 1e-6, free)["seconds"])
    calls = []
    real = model.two_level_allreduce

    def spy(*a, **k):
        calls.append(a[1])
        return real(*a, **k)
    monkeypatch.setattr(model, "two_level_allreduce", spy)
    whatif.two_level_time(s, 16, 8, 10e9, 100e9, free)
    assert calls == [[8, 8]]


def test_two_level_picked_and_named(tmp_path, capsys):
    log = _write(tmp_path, "one.bk.log", "c\n1\n1\n10000,8000000\n")   # 8 MB ready at 10 ms
    common = ["--timeline", log, "--add-gbs", "inf", "--iter-ms", "100", "--ranks", "16",
              "--gbit", "10", "--gpus-per-host", "8"]
    fast = _whatif_json(capsys, [*common, "--intra-gbit", "100"])
    (r,) = fast["results"]
    assert fast["gpus_per_host"] == 8 and fast["intra_gbit"] == 100
    assert r["algorithm"] == "two-level" and r["overhead_s"] == approx(7.52e-3)
    assert r["scaling_factor"] == approx(r["two_level_scaling_factor"])
    assert r["flat_scaling_factor"] == approx(100 / 112)
    (r,) = _whatif_json(capsys, [*common, "--intra-gbit", "10"])["results"]
    assert r["algorithm"] == "flat" and r["overhead_s"] == approx(12e-3)
    assert r["two_level_scaling_factor"] == approx(100 / 117.6)
    assert cli.main(["whatif", *common, "--intra-gbit", "100", "--ranks", "8,16"]) == 0
    text = capsys.readouterr().out
    assert "faster of the flat ring (F) and the two-level all-reduce (2L)" in text
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()
            if line.split()[:1] in (["8"], ["16"])}
    assert rows["16"] == [f"{100 / 107.52:.3f}", "2L"] and rows["8"][1] == "F"


def test_gpus_per_host_bad_input(tmp_path, capsys):
    log = _write(tmp_path, "one.bk.log", "c\n1\n1\n10000,8000000\n")
    base = ["--timeline", log, "--add-gbs", "1", "--iter-ms", "100"]
    assert "needs --intra-gbit" in _error(capsys, [*base, "--gpus-per-host", "8"])
    assert "needs --gpus-per-host" in _error(capsys, [*base, "--intra-gbit", "100"])
    err = _error(capsys, [*base, "--gpus-per-host", "8", "--intra-gbit", "100",
                          "--ranks", "12"])
    assert "--ranks 12" in err and "hosts of 8" in err


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("text, where, what", [
    ("c\nx\n3\n", ":2:", "the number of batches"),
    ("c\n1\n", ":3:", "the file ends there"),
    ("c\n1\n3\n10,4\n10,4\n", ":6:", "1 batch(es) x 3 layers = 3 lines"),
    ("c\n1\n2\n10,4\n10;4\n", ":5:", "expected 'wait_us,bytes'"),
    ("c\n1\n2\n10,4\n10,4.5\n", ":5:", "expected 'wait_us,bytes'"),
    ("c\n1\n2\n10,4\n-1,4\n", ":5:", "negative"),
    ("c\n2\n1\n10,4\n10,8\n", ":5:", "layer 1 of batch 2 has 8 bytes, batch 1 had 4"),
    ("c\n1\n1\nnan,4\n", ":4:", "expected 'wait_us,bytes'"),
])
def test_bad_bk_log_named(tmp_path, capsys, text, where, what):
    path = _write(tmp_path, "bad.bk.log", text)
    err = _error(capsys, ["--timeline", path, "--add-gbs", "1", "--iter-ms", "10"])
    assert f"{path}{where}" in err and what in err


@pytest.mark.parametrize("data, what", [
    ('{"grads": [\n{"ready_s": 0.1,\n "nbytes": 4}\n', ":4: not valid JSON"),
    ('{"grads": [{"ready_s": 0.1, "nbytes": 4}, {"ready_s": -1, "nbytes": 4}], "bwd_s": 1}',
     ": grads[1].ready_s must be a number >= 0, got -1"),
    ('{"grads": [{"ready_s": 0.1, "nbytes": 4.5}], "bwd_s": 1}',
     ": grads[0].nbytes must be an integer >= 0"),
    ('{"grads": [{"ready_s": 0.1, "nbytes": 4}]}', ": bwd_s is missing"),
    ('{"grads": []}', ": grads is empty"),
    ('{"results": []}', ": JSON that is neither a torch.profiler trace"),
    ('{"traceEvents": []}', ": no backward found"),
    ('{"grads": [{"ready_s": 0.1, "nbytes": 4}], "bwd_s": 1, "t_add": {"points": [[1, -1]]}}',
     ": t_add.points must be a list of [bytes, seconds] pairs"),
])
def test_bad_json_named(tmp_path, capsys, data, what):
    path = _write(tmp_path, "bad.json", data)
    err = _error(capsys, ["--timeline", path, "--iter-ms", "10"])
    assert f"{path}{what}" in err


def test_bad_arguments(tmp_path, capsys):
    log = _write(tmp_path, "m.bk.log", BK_LOG)
    assert f"cannot read {tmp_path}/nope.log" in _error(capsys, ["--timeline",
                                                                  str(tmp_path / "nope.log")])
    assert "cannot read" in _error(capsys, ["--timeline", log, "--iter-ms", "1",
                                            "--add-cost", str(tmp_path / "nope")])
    assert "not both" in _error(capsys, ["--timeline", log, "--iter-ms", "1", "--add-gbs", "1",
                                         "--add-cost", log])
    assert "drop --model" in _error(capsys, ["--timeline", log, "--model", "mlp"])
    err = _error(capsys, ["--timeline", log, "--iter-ms", "1",
                          "--add-cost", _write(tmp_path, "a.log", "1,2,3\n")])
    assert f"{tmp_path}/a.log:1: expected 'bytes,seconds'" in err


def test_device_cuda_fails_clearly_without_cuda(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is available here: this checks the error without one")
    err = _error(capsys, ["--device", "cuda", "--model", "mlp"])
    assert "--device cuda: CUDA is not available here" in err and "--timeline" in err
    assert "only cpu and cuda" in _error(capsys, ["--device", "meta"])


def test_cpu_record_timeline_api():
    """record_timeline's device path on the CPU (the CUDA one differs only in its clock)."""
    model, inputs, loss_fn = whatif.build("mlp", 4, device="cpu")
    tl = whatif.record_timeline(model, inputs, loss_fn, iters=1, warmup=0, device="cpu")
    assert len(tl.grads) == 8 and tl.iter_s > tl.bwd_s >= tl.grads[-1].ready_s > 0


# ----------------------------------------------------------------------------- the paper's logs

PAPER = Path(__file__).resolve().parent / "data" / "training-bottleneck"
# scaling factors of the paper's simulator (netx-repo/training-bottleneck, simulation/,
# commit f81b140), replayed on a virtual clock: (model, compression, ranks, Gbit/s) -> factor
SIMULATOR = {
    ("resnet50", 1, 16, 10): 0.571763, ("resnet50", 1, 64, 25): 0.910344,
    ("resnet50", 2, 32, 10): 0.843934, ("resnet50", 10, 64, 1): 0.539749,
    ("resnet101", 1, 32, 25): 0.922835, ("resnet101", 5, 64, 10): 0.996818,
    ("vgg16", 1, 16, 40): 0.658936, ("vgg16", 2, 64, 25): 0.722825,
    ("vgg16", 10, 32, 10): 0.996922,
}
BATCH_MS = {"resnet50": 128.0858, "resnet101": 192.0060, "vgg16": 194.5235}


def test_paper_logs_match_the_simulator(capsys):
    for (model, c, n, gb), want in SIMULATOR.items():
        out = _whatif_json(capsys, ["--timeline", str(PAPER / f"{model}.bk.log"),
                                    "--add-cost", str(PAPER / "cuda_vec_add.log"),
                                    "--iter-ms", str(BATCH_MS[model]), "--ranks", str(n),
                                    "--gbit", str(gb), "--compression", str(c)])
        assert out["results"][0]["scaling_factor"] == approx(want, rel=0.005)
