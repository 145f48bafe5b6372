"""The monitoring files in docker/ agree with the metrics contract (docs/metrics-spec.md).

No Prometheus, Grafana or Docker engine is needed: the dashboard's PromQL expressions are
checked against the metric names of the spec, the committed dashboard against its generator
(tools/dev/dashboard.py, where grafana-foundation-sdk is installed), and the compose /
Prometheus / provisioning files are parsed (and `docker compose config` is run where a compose
CLI exists).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "linerate.json"
SPEC = ROOT / "docs" / "metrics-spec.md"

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
METRIC_RE = re.compile(r"linerate_[a-z_]+")
JOB_MATCHER = re.compile(r'\bjob\s*=~\s*"\$job"')
HOST_MATCHER = re.compile(r'\bhost\s*=~\s*"\$host"')

try:
    import yaml
except ImportError:  # pragma: no cover - PyYAML comes with torch's dependencies here
    yaml = None
needs_yaml = pytest.mark.skipif(yaml is None, reason="PyYAML is not installed")


# ----------------------------------------------------------------------------- helpers
def spec_metrics() -> dict[str, str]:
    """{metric name: type} from the table of docs/metrics-spec.md."""
    out = {}
    for line in SPEC.read_text().splitlines():
        m = re.match(r"\|\s*(linerate_[a-z_]+)\s*\|\s*([a-z]+)", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(dash: dict):
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])  # panels inside collapsed rows


def dashboard_exprs(dash: dict | None = None) -> list[tuple[str, str]]:
    """[(panel title, expr)] for every query of every panel."""
    dash = dash or load_dashboard()
    return [(p.get("title", ""), t["expr"]) for p in all_panels(dash)
            for t in p.get("targets", []) if t.get("expr")]


def selectors(expr: str):
    """Yield (metric name, the text between the braces that follow it, or None)."""
    for m in METRIC_RE.finditer(expr):
        rest = expr[m.end():].lstrip()
        if rest.startswith("{"):
            yield m.group(0), rest[1:rest.index("}")]
        else:
            yield m.group(0), None


def resolve(name: str, metrics: dict[str, str]) -> str | None:
    """The spec metric a series name belongs to (histogram suffixes allowed), else None."""
    if name in metrics:
        return None if metrics[name] == "histogram" else name  # a bare histogram has no series
    for suffix in HISTOGRAM_SUFFIXES:
        base = name[: -len(suffix)]
        if name.endswith(suffix) and metrics.get(base) == "histogram":
            return base
    return None


# ----------------------------------------------------------------------------- the spec
def test_spec_lists_the_metrics():
    metrics = spec_metrics()
    assert len(metrics) >= 10, metrics
    assert metrics["linerate_collective_seconds"] == "histogram"
    assert all(t in ("gauge", "counter", "histogram") for t in metrics.values()), metrics


# ----------------------------------------------------------------------------- dashboard
def test_dashboard_loads():
    dash = load_dashboard()
    assert dash["uid"] == "linerate"
    assert 36 <= dash["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("job", "host"):
        v = variables[name]
        assert v["type"] == "query"
        query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        assert query.startswith("label_values(linerate_info") and query.endswith(f", {name})")
        assert v["datasource"]["uid"] == "${datasource}"
        assert v["includeAll"] and v["allValue"] == ".*", name  # the selectors' =~ take "All"
    ids = [p["id"] for p in all_panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in all_panels(dash):
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p.get("targets"), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]


def test_dashboard_covers_every_metric():
    used = set()
    metrics = spec_metrics()
    for _title, expr in dashboard_exprs():
        used.update(filter(None, (resolve(n, metrics) for n, _ in selectors(expr))))
    assert used == set(metrics), f"not on the dashboard: {sorted(set(metrics) - used)}"


def test_dashboard_uses_only_spec_metric_names():
    metrics = spec_metrics()
    exprs = dashboard_exprs()
    assert len(exprs) >= 10
    for title, expr in exprs:
        names = [n for n, _ in selectors(expr)]
        assert names, f"{title}: no linerate metric in {expr!r}"
        for name in names:
            assert resolve(name, metrics), f"{title}: {name} is not in docs/metrics-spec.md " \
                                           f"(expr {expr!r})"


def test_every_selector_filters_job_and_host():
    for title, expr in dashboard_exprs():
        for name, matchers in selectors(expr):
            assert matchers is not None, f"{title}: {name} has no label matchers in {expr!r}"
            assert JOB_MATCHER.search(matchers), f"{title}: {name} not filtered by $job"
            assert HOST_MATCHER.search(matchers), f"{title}: {name} not filtered by $host"


def test_dashboard_queries_are_well_formed():
    for title, expr in dashboard_exprs():
        assert expr.count("(") == expr.count(")"), f"{title}: {expr!r}"
        assert expr.count("{") == expr.count("}"), f"{title}: {expr!r}"
        assert expr.count('"') % 2 == 0, f"{title}: {expr!r}"
        if "_bucket" in expr:
            assert "histogram_quantile(" in expr and re.search(r"\ble\b", expr), title
        for m in re.finditer(r"linerate_[a-z_]+_total", expr):
            # counters are only read through rate()/increase()
            before = expr[: m.start()]
            assert re.search(r"(rate|increase)\(\s*$", before), f"{title}: bare counter {expr!r}"
        for window in re.findall(r"\[([^\]]+)\]", expr):
            assert window == "$__rate_interval", f"{title}: window {window!r}"


def test_dashboard_units():
    dash = load_dashboard()
    units = {p["title"]: p["fieldConfig"]["defaults"].get("unit")
             for p in all_panels(dash) if p["type"] in ("timeseries", "bargauge", "stat")}
    for title, expr in dashboard_exprs(dash):
        if title not in units:
            continue
        unit = units[title]
        if "utilization" in title.lower() or "against siblings" in title.lower() \
                or "time waited" in title.lower():
            assert unit == "percentunit", title
        elif "latency" in title.lower() or "skew" in title.lower():
            assert unit == "s", title
        elif "bytes/s" in title.lower() or "bandwidth" in title.lower() or "capacity" in title.lower():
            assert unit == "Bps", title
        elif "queue" in title.lower():
            assert unit == "bytes", title


def test_dashboard_panels_present():
    dash = load_dashboard()
    exprs = "\n".join(e for _, e in dashboard_exprs(dash))
    for needle in ("linerate_link_utilization_ratio", "/ on (host, interface)",
                   "linerate_link_capacity_bytes_per_second",
                   "sum by (host, rank, peer) (rate(linerate_sent_bytes_total",
                   "linerate_bus_bandwidth_bytes_per_second",
                   "histogram_quantile(0.5,", "histogram_quantile(0.99,",
                   "rate(linerate_collective_seconds_count", "rate(linerate_tcp_retransmits_total",
                   "linerate_send_queue_bytes", "linerate_info"):
        assert needle in exprs, needle
    tables = [p for p in all_panels(dash) if p["type"] == "table"]
    assert any(t["targets"][0]["expr"].startswith("linerate_info") and t["targets"][0].get("instant")
               for t in tables)


def test_dashboard_slow_ranks_and_links_row():
    dash = load_dashboard()
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert rows == ["Links", "Peers", "Collectives", "Slow ranks and links", "Ranks"], rows
    start = next(i for i, p in enumerate(dash["panels"]) if p["title"] == "Slow ranks and links")
    row = []
    for p in dash["panels"][start + 1:]:
        if p["type"] == "row":
            break
        row.append(p)
    exprs = {p["title"]: [t["expr"] for t in p["targets"]] for p in row}
    text = "\n".join(e for es in exprs.values() for e in es)
    for needle in ('"kind", "shm", "interface", "shm"', '"kind", "rdma", "interface", ".+:.+"',
                   "sum by (peer) (rate(linerate_peer_wait_seconds_total",
                   "max by (job) (linerate_slowest_rank", "linerate_slow_window_collectives",
                   "max by (job, late_rank) (linerate_rank_late_ratio",
                   "max by (job, late_rank) (linerate_rank_lateness_seconds",
                   "histogram_quantile(0.5, sum by (op, le) (rate(linerate_entry_skew_seconds_bucket",
                   "histogram_quantile(0.99, sum by (op, le) (rate(linerate_entry_skew_seconds_bucket",
                   "linerate_link_rate_ratio", "linerate_slow_link",
                   "linerate_link_rate_bytes_per_second"):
        assert needle in text, needle
    by_type = {p["title"]: p for p in row}
    slowest = by_type["Slowest rank"]
    assert slowest["type"] == "stat"
    mapping = slowest["fieldConfig"]["defaults"]["mappings"][0]
    assert mapping["type"] == "value" and mapping["options"]["-1"]["text"] == "nobody"
    late = by_type["Ranks entering last"]
    assert late["type"] == "table" and all(t["instant"] for t in late["targets"])
    kinds = by_type["Bytes/s per interface kind"]["targets"]
    assert [t["legendFormat"] for t in kinds] == ["{{host}} {{kind}} tx", "{{host}} {{kind}} rx"]


# ----------------------------------------------------------------------------- the generator
def test_dashboard_is_the_generators_output():
    """docker/grafana/dashboards/linerate.json is what tools/dev/dashboard.py builds (edit the
    generator, then `python -m linerate.tools.dev.dashboard --write`)."""
    if sys.version_info < (3, 11):
        pytest.skip("grafana-foundation-sdk (the test extra) needs Python >= 3.11")
    pytest.importorskip("grafana_foundation_sdk",
                        reason="grafana-foundation-sdk (the test extra) is not installed")
    from linerate.tools.dev import dashboard

    assert DASHBOARD.read_text() == dashboard.render(), \
        "the committed dashboard is not the generator's output: run " \
        "`python -m linerate.tools.dev.dashboard --write`"


# ----------------------------------------------------------------------------- provisioning
@needs_yaml
def test_grafana_provisioning():
    ds = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    dash = load_dashboard()
    current = {v["name"]: v for v in dash["templating"]["list"]}["datasource"]["current"]
    assert current["value"] == source["uid"], "the dashboard's default data source is not provisioned"
    prov = yaml.safe_load((DOCKER / "grafana/provisioning/dashboards/linerate.yaml").read_text())
    (provider,) = prov["providers"]
    assert provider["type"] == "file"
    path = provider["options"]["path"]
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"./grafana/dashboards:{path}:ro" in mounts
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in mounts


@needs_yaml
def test_prometheus_config():
    cfg = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    assert cfg["global"]["scrape_interval"] == "5s"
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "linerate"]
    (sd,) = job["dns_sd_configs"]
    assert sd["type"] == "A" and sd["port"] == 9400
    assert set(sd["names"]) == {"rank0", "ranks"}


# ----------------------------------------------------------------------------- compose
@needs_yaml
def test_compose_file():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) >= {"rank0", "ranks", "prometheus", "grafana"}
    want = ("torchrun --nnodes ${LINERATE_RANKS:-4} --nproc-per-node 1 --rdzv-backend c10d "
            "--rdzv-endpoint rank0:29400 --rdzv-id linerate-demo -m linerate.tools.bench "
            "--metrics-port 9400 --loop")
    for name in ("rank0", "ranks"):
        assert services[name]["command"] == want, name
        assert services[name]["build"]["dockerfile"] == "docker/Dockerfile"
    assert services["rank0"]["hostname"] == "rank0"  # torchrun there hosts the rendezvous
    assert services["ranks"]["deploy"]["replicas"] == "${LINERATE_WORKERS:-3}"
    assert services["prometheus"]["image"].startswith("prom/prometheus")
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]
    assert services["grafana"]["image"].startswith("grafana/grafana")
    env = services["grafana"]["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert any(str(p).endswith("3000:3000") for p in services["grafana"]["ports"])
    assert any(str(p).endswith("9090:9090") for p in services["prometheus"]["ports"])


def test_dockerfile():
    text = (DOCKER / "Dockerfile").read_text()
    froms = [line for line in text.splitlines() if line.startswith("FROM ")]
    assert froms == ["FROM python:3.11-slim"]
    assert re.search(r"--index-url https://download\.pytorch\.org/whl/cpu torch==2\.13\.0\b", text)
    assert "pip install ." in text


def _compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True,
                                 timeout=30).returncode == 0:
        return [docker, "compose"]
    v1 = shutil.which("docker-compose")
    return [v1] if v1 else None


@needs_yaml
@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [None, 7])
def test_compose_config_validates(tmp_path, workers):
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no compose CLI (`docker compose` plugin or docker-compose) on PATH")
    path = DOCKER / "compose.yaml"
    if cli[0].endswith("docker-compose"):
        # Compose v1 predates the top-level `name`; validate the rest with it.
        text = "".join(line for line in path.read_text().splitlines(keepends=True)
                       if not line.startswith("name:"))
        path = tmp_path / "compose.yaml"
        path.write_text(text)
    env = dict(os.environ)
    env.pop("LINERATE_WORKERS", None)
    env.pop("LINERATE_RANKS", None)
    if workers:
        env.update(LINERATE_WORKERS=str(workers), LINERATE_RANKS=str(workers + 1))
    r = subprocess.run(cli + ["-f", str(path), "--project-directory", str(DOCKER), "config"],
                       capture_output=True, text=True, env=env, timeout=50)
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    ranks = (workers or 3) + 1
    assert int(cfg["services"]["ranks"]["deploy"]["replicas"]) == ranks - 1
    command = cfg["services"]["rank0"]["command"]
    command = command if isinstance(command, str) else " ".join(command)
    assert f"--nnodes {ranks} " in command
