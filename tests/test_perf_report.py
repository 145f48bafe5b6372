"""tools/dev/perf_report.py: the generated docs/performance.md, and the benchmarks it runs.

The report's tables are rendered from the JSON its benchmarks write; re-running a setup
replaces its section and keeps the others. The latency benchmark runs for real (2 ranks, a few
calls): its rows carry linerate and Gloo from the same run."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from linerate.tools.dev import perf_report as pr

ROOT = Path(__file__).resolve().parents[1]
MACHINE = {"cores": 2, "cpu": "test cpu", "kernel": "6.0", "copy_gbs": 10.0, "torch": "2.13.0",
           "linerate": "0.2.0", "python": "3.11", "date": "2026-01-01"}


def _bench_json(world=2, raw=None):
    return {"world_size": world, "raw_link": raw, "results": [
        {"op": "all_reduce", "size_bytes": 64 << 20,
         "backends": {"linerate": {"busbw_gbps": 2.0, "time_us": 5.0},
                      "gloo": {"busbw_gbps": 1.0, "time_us": 10.0}}}]}


def test_bench_rows_memory_and_link_bounds():
    t = pr.bench_rows([{"json": _bench_json(), "label": ""}], MACHINE, "memory")
    assert "| 2 | all_reduce | 64 MiB | 2.000 | 1.000 | 2.00x | 10.000 | 20% |" in t
    t = pr.bench_rows([{"json": _bench_json(4, {"capacity_gbit_s": 0.94}), "label": ""}],
                      MACHINE, "link")
    # GB/s shown as Gbit/s against the raw capacity the bench measured
    assert "| 4 | all_reduce | 64 MiB | 16.000 | 8.000 | 2.00x | 0.940 | 1702% |" in t


def test_latency_and_fusion_rows():
    rows = [{"backend": "linerate", "op": "all_reduce", "bytes": 4096, "ranks": 2,
             "median_us": 20.0, "p90_us": 30.0},
            {"backend": "gloo", "op": "all_reduce", "bytes": 4096, "ranks": 2,
             "median_us": 300.0, "p90_us": 400.0}]
    t = pr.latency_bench_rows([{"rows": rows, "label": "LINERATE_SHM=0"}], MACHINE)
    assert "| 2 | TCP (LINERATE_SHM=0) | all_reduce 4 KiB | linerate | 20.0 | 30.0 | 15.00x |" in t
    out = ("fusion: 2000 async all_reduce of 4096 bytes, 4 ranks (local); ...\n"
           "  gloo        10.000 s\n  linerate     0.500 s     20.0x faster\n")
    assert "| 4 | 2000 | 4096 | 0.500 | 10.000 | 20.0x |" in pr.fusion_rows([{"stdout": out}], MACHINE)
    with pytest.raises(RuntimeError, match="no fusion result"):
        pr.fusion_rows([{"stdout": "nothing"}], MACHINE)


def test_a_rerun_replaces_its_section_and_keeps_the_others():
    one, two = pr.SETUPS[0], pr.SETUPS[1]
    page = pr.assemble({one.key: pr.section(one, "old one"), two.key: pr.section(two, "old two")})
    sections = pr.parse_sections(page)
    sections[one.key] = pr.section(one, "new one")
    again = pr.assemble(sections)
    assert "new one" in again and "old two" in again and "old one" not in again
    assert again.count(f"<!-- perf:{one.key} -->") == 1
    assert pr.assemble(pr.parse_sections(again)) == again  # stable


def test_every_section_of_the_page_names_its_machine_and_command():
    """Each generated section of docs/performance.md: its setup's title and description, a
    machine line, and exactly the commands the setup runs (a setup changed without
    regenerating its section fails here: `python -m linerate.tools.dev.perf_report --only KEY`)."""
    page = (ROOT / "docs" / "performance.md").read_text()
    sections = pr.parse_sections(page)
    assert sections, "docs/performance.md holds no generated section"
    setups = {s.key: s for s in pr.SETUPS}
    assert set(sections) <= set(setups)
    for key, text in sections.items():
        s = setups[key]
        assert text.startswith(f"<!-- perf:{key} -->\n## {s.title}\n\n{s.about}\n\nMachine: "), key
        assert re.search(r"^Machine: \d+ cores \(.+\), memory copy [\d.]+ GB/s, Linux .+, "
                         r"Python [\d.]+, torch .+, linerate .+; \d{4}-\d\d-\d\d\.$", text, re.M), key
        shown = re.search(r"```text\n(.*?)\n```", text, re.S)
        assert shown and shown.group(1).splitlines() == pr.commands(s), (key, shown and shown.group(1))
        assert "| linerate" in text or "linerate" in text.split("```text")[1], key


@pytest.mark.timeout(180)
def test_latency_bench_measures_both_backends_in_one_run(tmp_path):
    out = tmp_path / "lat.json"
    p = subprocess.run([sys.executable, "-m", "linerate.tools.dev.latency_bench", "--nproc", "2",
                        "--iters", "20", "--warmup", "5", "--mpi", "off", "--json", str(out)],
                       capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(out.read_text())
    got = {(r["backend"], r["op"]) for r in rows}
    assert got == {(b, o) for b in ("linerate", "gloo") for o in ("all_reduce", "barrier")}
    assert all(r["median_us"] > 0 and r["ranks"] == 2 for r in rows)
    assert "| all_reduce | 4096 | 2 | linerate |" in p.stdout


def test_a_plot_is_written_by_its_command_and_shown_under_its_table():
    sweep = next(s for s in pr.SETUPS if s.key == "sweep")
    assert f"--plot {pr.IMG_DIR}/perf-sweep.png" in pr.commands(sweep)[0]
    body = sweep.render([{"json": _bench_json(), "label": ""}], MACHINE)
    assert "| 2 | all_reduce | 64 MiB |" in body and body.endswith(f"]({pr.IMG_DIR}/perf-sweep.png)")
    assert pr.capture([{"stdout": "frame\n"}], MACHINE) == "```text\nframe\n```"


def test_every_picture_of_the_page_exists_and_comes_from_its_sections_command():
    page = (ROOT / "docs" / "performance.md").read_text()
    for key, text in pr.parse_sections(page).items():
        for img in re.findall(r"!\[[^]]*\]\(([^)]+)\)", text):
            assert (ROOT / "docs" / img).is_file(), (key, img)
            assert f"--plot {img}" in text.split("```text\n", 1)[1].split("```", 1)[0], (key, img)


@pytest.mark.timeout(240)
def test_top_capture_prints_one_frame_of_a_live_benchmark():
    import os
    env = {k: v for k, v in os.environ.items() if not k.startswith("LINERATE_")}
    env.update(LINERATE_SHM="0", LINERATE_LINK_CAPACITY="10gbit")
    p = subprocess.run([sys.executable, "-m", "linerate.tools.dev.top_capture", "--nproc", "2",
                        "--max-bytes", "256K"], env=env, capture_output=True, text=True,
                       timeout=230)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "2/2 endpoints up" in p.stdout and "all_reduce      2" in p.stdout, p.stdout
    assert " lo " in p.stdout and "10.0 Gbit/s" in p.stdout, p.stdout
