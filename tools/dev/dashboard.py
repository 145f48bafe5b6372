"""The Grafana dashboard of docker/grafana/dashboards/linerate.json, built with Grafana's own
builder library (grafana-foundation-sdk on PyPI, the Grafana 11.1 flavour that the compose
file's Grafana runs):

    python -m linerate.tools.dev.dashboard > docker/grafana/dashboards/linerate.json
    python -m linerate.tools.dev.dashboard --write          # the same, from a checkout
    python -m linerate.tools.dev.dashboard --check          # exit 1 if the file differs

Needs ``pip install 'grafana-foundation-sdk==1769699681!11.1.0'`` (Python >= 3.11; the
package has no dependencies). tests/test_dashboard.py checks that the committed file is this
module's output, and every metric name and selector in it against docs/metrics-spec.md;
tests/test_prometheus.py runs every query against a real Prometheus scraping real ranks.

Every query filters on the dashboard's ``job`` and ``host`` variables (``SEL``) and reads its
data source from the ``datasource`` variable. Rows: Links, Peers, Collectives, Slow ranks and
links, Ranks.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: Where the dashboard lives in a checkout (the module sits in tools/dev/).
DEFAULT_PATH = Path(__file__).resolve().parents[2] / "docker" / "grafana" / "dashboards" / \
    "linerate.json"
#: The label matchers of every selector: the dashboard's job and host variables.
SEL = 'job=~"$job", host=~"$host"'
#: The SDK release the committed file was built with (pyproject.toml's test extra pins it).
SDK = "grafana-foundation-sdk==1769699681!11.1.0"

WIDTH = 12   # two panels side by side on Grafana's 24-column grid
HEIGHT = 8


def _sdk():
    try:
        from grafana_foundation_sdk.builders import (bargauge, common, dashboard, prometheus,
                                                     stat, table, timeseries)
        from grafana_foundation_sdk.cog.encoder import JSONEncoder
        from grafana_foundation_sdk.models import common as cm
        from grafana_foundation_sdk.models import dashboard as dm
        from grafana_foundation_sdk.models import prometheus as pm
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit(f"the dashboard generator needs {SDK!r} (Python >= 3.11): {e}")
    return dict(bargauge=bargauge, common=common, dashboard=dashboard, prometheus=prometheus,
                stat=stat, table=table, timeseries=timeseries, JSONEncoder=JSONEncoder, cm=cm,
                dm=dm, pm=pm)


def rate(counter: str, extra: str = "") -> str:
    """``rate(counter{job, host[, extra]}[$__rate_interval])``."""
    sel = SEL + (f", {extra}" if extra else "")
    return f"rate({counter}{{{sel}}}[$__rate_interval])"


def series(name: str, extra: str = "") -> str:
    """``name{job, host[, extra]}``."""
    sel = SEL + (f", {extra}" if extra else "")
    return f"{name}{{{sel}}}"


def per_host(expr, extra: str = "", by: str = "host, interface") -> str:
    """A per-rank quantity (``expr(extra)``: a selector or a rate with matchers ``extra``) per
    host and interface: summed over a host's ranks for a NIC, which they share; for ``shm`` the
    busiest rank's (its capacity is what one rank copies per second: the ranks do not share
    it)."""
    extra = f"{extra}, " if extra else ""
    nic, shm = expr(extra + 'interface!="shm"'), expr(extra + 'interface="shm"')
    return f"sum by ({by}) ({nic}) or max by ({by}) ({shm})"


def by_kind(counter: str, extra: str = "") -> str:
    """Bytes/s of a byte counter per host and interface kind: ``shm`` (shared memory), ``rdma``
    (an RDMA device:port; Linux interface names cannot hold a colon) or ``tcp``."""
    inner = rate(counter, extra)
    inner = f'label_replace({inner}, "kind", "tcp", "interface", ".*")'
    inner = f'label_replace({inner}, "kind", "rdma", "interface", ".+:.+")'
    inner = f'label_replace({inner}, "kind", "shm", "interface", "shm")'
    return f"sum by (host, kind) ({inner})"


def build() -> dict:
    """The dashboard as Grafana's JSON model (a dict)."""
    s = _sdk()
    db, common, prometheus = s["dashboard"], s["common"], s["prometheus"]
    timeseries, stat, table, bargauge = s["timeseries"], s["stat"], s["table"], s["bargauge"]
    cm, dm, pm = s["cm"], s["dm"], s["pm"]
    ds = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
    ids = iter(range(1, 1000))

    def target(ref: str, expr: str, legend: str, instant: bool = False):
        t = (prometheus.Dataquery().ref_id(ref).datasource(ds)
             .editor_mode(pm.QueryEditorMode.CODE).expr(expr).legend_format(legend))
        if instant:
            t = t.instant().format(pm.PromQueryFormat.TABLE)
        else:
            t = t.range()
        return t

    def targets(panel, queries):
        for ref, (expr, legend) in zip("ABCDEFGH", queries):
            panel = panel.with_target(target(ref, expr, legend))
        return panel

    def graph(title: str, description: str, unit: str, queries, soft_max: float | None = None,
              threshold: float | None = None, width: int = WIDTH):
        p = (timeseries.Panel().id(next(ids)).title(title).description(description)
             .datasource(ds).span(width).height(HEIGHT).unit(unit).min(0)
             .draw_style(cm.GraphDrawStyle.LINE).line_width(1).fill_opacity(10)
             .show_points(cm.VisibilityMode.NEVER).span_nulls(False).axis_soft_min(0)
             .legend(common.VizLegendOptions().display_mode(cm.LegendDisplayMode.TABLE)
                     .placement(cm.LegendPlacement.BOTTOM).show_legend(True)
                     .calcs(["mean", "max"]))
             .tooltip(common.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI)
                      .sort(cm.SortOrder.DESCENDING)))
        if soft_max is not None:
            p = p.axis_soft_max(soft_max)
        if threshold is not None:
            p = (p.thresholds(db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(
                    [dm.Threshold(value=None, color="green"),
                     dm.Threshold(value=threshold, color="red")]))
                 .thresholds_style(common.GraphThresholdsStyleConfig()
                                   .mode(cm.GraphThresholdsStyleMode.DASHED)))
        return targets(p, queries)

    def row(title: str):
        return db.Row(title).id(next(ids))

    d = (db.Dashboard("linerate").uid("linerate")
         .description("linerate torch.distributed backend: links, peers, collectives, slow ranks "
                      "and links (metrics: docs/metrics-spec.md)")
         .tags(["linerate", "pytorch", "network"]).editable().tooltip(dm.DashboardCursorSync.CROSSHAIR)
         .refresh("5s").time("now-15m", "now").timezone("browser").version(1)
         .annotation(db.AnnotationQuery().name("Annotations & Alerts").built_in(1).enable(True)
                     .hide(True).icon_color("rgba(0, 211, 255, 1)").type("dashboard")
                     .datasource(dm.DataSourceRef(type_val="grafana", uid="-- Grafana --")))
         .with_variable(db.DatasourceVariable("datasource").label("Data source")
                        .type("prometheus").regex("")
                        .current(dm.VariableOption(selected=False, text="Prometheus",
                                                   value="prometheus"))))
    for name, query in (("job", "label_values(linerate_info, job)"),
                        ("host", 'label_values(linerate_info{job=~"$job"}, host)')):
        d = d.with_variable(
            db.QueryVariable(name).label(name).datasource(ds)
            .query({"qryType": 1, "query": query,
                    "refId": "PrometheusVariableQueryEditor-VariableQuery"})
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*").regex("")
            .current(dm.VariableOption(selected=True, text=["All"], value=["$__all"])))

    sent, received = "linerate_sent_bytes_total", "linerate_received_bytes_total"
    moved = "linerate_interface_bytes_total"
    capacity = "max by (host, interface) (" + series("linerate_link_capacity_bytes_per_second") + ")"

    def moved_rate(direction: str):
        return lambda extra: rate(moved, f'direction="{direction}", {extra}')

    # ------------------------------------------------------------------ Links
    d = d.with_row(row("Links"))
    d = d.with_panel(graph(
        "Link utilization (exporter)",
        "linerate_link_utilization_ratio: linerate_interface_bytes_total over each rank's last "
        "metrics window (LINERATE_METRICS_WINDOW) divided by the interface capacity; a NIC's "
        "summed over the ranks of a host, shm's the busiest rank's (the capacity of shm is what "
        "one rank copies per second, and a copy that several peers read counts once). Absent "
        "for interfaces without a known capacity (loopback, unless LINERATE_LINK_CAPACITY is "
        "set). shm reads above 100% only where LINERATE_LINK_CAPACITY sets its capacity too "
        "low.",
        "percentunit",
        [(per_host(lambda extra: series("linerate_link_utilization_ratio", extra),
                   by="host, interface, direction"),
          "{{host}} {{interface}} {{direction}}")], soft_max=1))
    d = d.with_panel(graph(
        "Link utilization (from byte counters)",
        "Rate of linerate_interface_bytes_total per interface, divided by the interface "
        "capacity (linerate_link_capacity_bytes_per_second): a NIC's summed over the ranks of "
        "a host, shm's the busiest rank's. The exporter's definition, independent of its "
        "window; smoothed over $__rate_interval.", "percentunit",
        [(f"({per_host(moved_rate('tx'))}) / on (host, interface) {capacity}",
          "{{host}} {{interface}} tx"),
         (f"({per_host(moved_rate('rx'))}) / on (host, interface) {capacity}",
          "{{host}} {{interface}} rx")], soft_max=1))
    d = d.with_panel(graph(
        "Bytes/s per interface",
        "linerate_interface_bytes_total per second of all ranks of a host, per interface "
        "(rail): a NIC's payload bytes (linerate frames); for shm the bytes the ranks wrote "
        "for their peers (tx: once, however many peers read them) and read of theirs (rx).",
        "Bps",
        [("sum by (host, interface) (" + rate(moved, 'direction="tx"') + ")",
          "{{host}} {{interface}} tx"),
         ("sum by (host, interface) (" + rate(moved, 'direction="rx"') + ")",
          "{{host}} {{interface}} rx")]))
    d = d.with_panel(targets(
        bargauge.Panel().id(next(ids)).title("Link capacity")
        .description("linerate_link_capacity_bytes_per_second by its source: driver "
                     "(/sys/class/net/IF/speed, an RDMA port's rate), setting "
                     "(LINERATE_LINK_CAPACITY), or for shm measured: the most one rank copies "
                     "per second, measured once per host when the shared segment is set up "
                     "(every rank of the host exports the same figure).")
        .datasource(ds).span(WIDTH).height(HEIGHT).unit("Bps").min(0)
        .display_mode(cm.BarGaugeDisplayMode.BASIC).orientation(cm.VizOrientation.HORIZONTAL)
        .show_unfilled(True)
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False)),
        [("max by (host, interface, source) ("
          + series("linerate_link_capacity_bytes_per_second") + ")",
          "{{host}} {{interface}} ({{source}})")]))

    # ------------------------------------------------------------------ Peers
    d = d.with_row(row("Peers"))
    d = d.with_panel(graph(
        "Sent bytes/s per peer",
        "Payload bytes per second each rank sends to each peer (all connections and interfaces).",
        "Bps", [(f"sum by (host, rank, peer) ({rate(sent)})", "{{host}} rank {{rank}} → {{peer}}")]))
    d = d.with_panel(graph(
        "Received bytes/s per peer", "Payload bytes per second each rank receives from each peer.",
        "Bps", [(f"sum by (host, rank, peer) ({rate(received)})",
                 "{{host}} rank {{rank}} ← {{peer}}")]))
    d = d.with_panel(graph(
        "TCP retransmits/s per peer",
        "rate of linerate_tcp_retransmits_total (TCP_INFO tcpi_total_retrans summed over the "
        "connections to the peer).", "pps",
        [(f"sum by (host, rank, peer) ({rate('linerate_tcp_retransmits_total')})",
          "{{host}} rank {{rank}} → {{peer}}")]))
    d = d.with_panel(graph(
        "Send queue depth per peer",
        "linerate_send_queue_bytes: bytes queued to the peer (linerate queue + kernel send "
        "queue).", "bytes",
        [("max by (host, rank, peer) (" + series("linerate_send_queue_bytes") + ")",
          "{{host}} rank {{rank}} → {{peer}}")]))

    # ------------------------------------------------------------------ Collectives
    bucket = "linerate_collective_seconds_bucket"
    d = d.with_row(row("Collectives"))
    d = d.with_panel(graph(
        "Bus bandwidth per op",
        "linerate_bus_bandwidth_bytes_per_second (nccl-tests busbw over the last window in which "
        "the op ran), averaged over the ranks.", "Bps",
        [("avg by (op) (" + series("linerate_bus_bandwidth_bytes_per_second") + ")", "{{op}}")]))
    d = d.with_panel(graph(
        "Collective latency p50 / p99 per op",
        "histogram_quantile over linerate_collective_seconds (queue to completion on the worker), "
        "all ranks, algorithms and sizes together.", "s",
        [(f"histogram_quantile({q}, sum by (op, le) ({rate(bucket)}))", f"{{{{op}}}} p{p}")
         for q, p in (("0.5", 50), ("0.99", 99))]))
    d = d.with_panel(graph(
        "Collectives/s per op",
        "Collectives completed per second by one rank (each rank takes part in every collective "
        "of its group), averaged over the ranks.", "ops",
        [("avg by (op) (sum by (job, host, rank, op) ("
          + rate("linerate_collective_seconds_count") + "))", "{{op}}")]))
    d = d.with_panel(graph(
        "Collective latency p99 per op and size",
        "histogram_quantile(0.99) per op and message-size bucket (upper bound of the per-rank "
        "message size).", "s",
        [(f"histogram_quantile(0.99, sum by (op, size_bucket, le) ({rate(bucket)}))",
          "{{op}} ≤{{size_bucket}}")]))
    d = d.with_panel(graph(
        "Collective bytes/s per op",
        "rate of linerate_collective_bytes_total: per-rank message size (nccl-tests size) per "
        "second, averaged over the ranks.", "Bps",
        [("avg by (op) (sum by (job, host, rank, op) ("
          + rate("linerate_collective_bytes_total") + "))", "{{op}}")]))

    # ------------------------------------------------------------------ Slow ranks and links
    skew = "linerate_entry_skew_seconds_bucket"
    d = d.with_row(row("Slow ranks and links"))
    d = d.with_panel(graph(
        "Bytes/s per interface kind",
        "linerate_interface_bytes_total per second of all ranks of a host by kind of interface: "
        "shm (shared memory between the ranks of a host: the bytes written for the peers, once "
        "however many read them, and read of theirs), rdma (an RDMA device:port) or tcp (every "
        "other interface).", "Bps",
        [(by_kind(moved, 'direction="tx"'), "{{host}} {{kind}} tx"),
         (by_kind(moved, 'direction="rx"'), "{{host}} {{kind}} rx")]))
    d = d.with_panel(graph(
        "Time waited for each peer",
        "rate of linerate_peer_wait_seconds_total, summed over the waiting ranks: seconds per "
        "second that ranks spent, from entering a collective, waiting for the peer's first "
        "contribution (100% = one rank's whole time). A rank that enters its collectives late "
        "stands out here.", "percentunit",
        [(f"sum by (peer) ({rate('linerate_peer_wait_seconds_total')})", "for rank {{peer}}")]))
    d = d.with_panel(targets(
        stat.Panel().id(next(ids)).title("Slowest rank")
        .description("linerate_slowest_rank: the rank that entered last in at least half of the "
                     "recent collectives (LINERATE_SLOW_RANK_MS or later), decided by every rank "
                     "from every rank's view; nobody: -1. Beside it "
                     "linerate_slow_window_collectives, the collectives it is decided over.")
        .datasource(ds).span(8).height(HEIGHT).unit("none").decimals(0)
        .mappings([dm.ValueMap(options={"-1": dm.ValueMappingResult(text="nobody",
                                                                       color="green", index=0)})])
        .thresholds(db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(
            [dm.Threshold(value=None, color="orange")]))
        .color_mode(cm.BigValueColorMode.VALUE).graph_mode(cm.BigValueGraphMode.NONE)
        .text_mode(cm.BigValueTextMode.VALUE_AND_NAME)
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False)),
        [("max by (job) (" + series("linerate_slowest_rank") + ")", "{{job}} slowest rank"),
         ("max by (job) (" + series("linerate_slow_window_collectives") + ")",
          "{{job}} collectives watched")]))
    late = (table.Panel().id(next(ids)).title("Ranks entering last")
            .description("linerate_rank_late_ratio: share of the recent collectives each rank "
                         "entered last, and linerate_rank_lateness_seconds: by how much on "
                         "average (only ranks that were late at least once).")
            .datasource(ds).span(24 - 8).height(HEIGHT)
            .show_header(True).cell_height(cm.TableCellHeight.SM)
            .sort_by([common.TableSortByFieldState().display_name("share entered last")
                      .desc(True)])
            .override_by_name("share entered last",
                              [dm.DynamicConfigValue(id_val="unit", value="percentunit")])
            .override_by_name("mean lateness", [dm.DynamicConfigValue(id_val="unit", value="s")])
            .with_transformation(dm.DataTransformerConfig(id_val="merge", options={}))
            .with_transformation(dm.DataTransformerConfig(id_val="organize", options={
                "excludeByName": {"Time": True},
                "indexByName": {"job": 0, "late_rank": 1, "Value #A": 2, "Value #B": 3},
                "renameByName": {"late_rank": "rank", "Value #A": "share entered last",
                                 "Value #B": "mean lateness"}})))
    for ref, name in (("A", "linerate_rank_late_ratio"), ("B", "linerate_rank_lateness_seconds")):
        late = late.with_target(target(ref, f"max by (job, late_rank) ({series(name)})", "",
                                       instant=True))
    d = d.with_panel(late)
    d = d.with_panel(graph(
        "Entry skew p50 / p99 per op",
        "histogram_quantile over linerate_entry_skew_seconds: how late the ranks entered their "
        "collectives, each relative to the first rank in, all ranks together.", "s",
        [(f"histogram_quantile({q}, sum by (op, le) ({rate(skew)}))", f"{{{{op}}}} p{p}")
         for q, p in (("0.5", 50), ("0.99", 99))]))
    d = d.with_panel(graph(
        "Link rate against siblings",
        "linerate_link_rate_ratio: a TCP connection's rate while sending over the median of its "
        "rank's other measured connections (smoothed), the slowest connection per peer and "
        "interface. The dashed line is LINERATE_SLOW_LINK_RATIO's default (0.6), below which a "
        "connection is named slow.", "percentunit",
        [("min by (host, rank, peer, interface) (" + series("linerate_link_rate_ratio") + ")",
          "{{host}} rank {{rank}} → {{peer}} {{interface}}")], threshold=0.6))
    d = d.with_panel(graph(
        "Slow TCP connections",
        "linerate_slow_link summed: connections of a host's ranks that run markedly slower than "
        "their siblings (LINERATE_SLOW_LINK_RATIO), per interface.", "none",
        [("sum by (host, interface) (" + series("linerate_slow_link") + ")",
          "{{host}} {{interface}}")]))
    d = d.with_panel(graph(
        "Connection bytes/s while sending (slowest / fastest)",
        "linerate_link_rate_bytes_per_second: what a TCP connection carried while it had data to "
        "send (TCP_INFO bytes acknowledged over busy time), the slowest and the fastest "
        "connection of a host's ranks per interface. Connections that moved less than 1 MiB "
        "since the last sample keep their last rate.", "Bps",
        [("min by (host, interface) (" + series("linerate_link_rate_bytes_per_second") + ")",
          "{{host}} {{interface}} slowest"),
         ("max by (host, interface) (" + series("linerate_link_rate_bytes_per_second") + ")",
          "{{host}} {{interface}} fastest")]))

    # ------------------------------------------------------------------ Ranks
    d = d.with_row(row("Ranks"))
    info = (table.Panel().id(next(ids)).title("Ranks (linerate_info)")
            .description("Version and configuration of every rank.")
            .datasource(ds).span(24).height(HEIGHT)
            .show_header(True).cell_height(cm.TableCellHeight.SM)
            .sort_by([common.TableSortByFieldState().display_name("rank").desc(False)])
            .with_transformation(dm.DataTransformerConfig(id_val="organize", options={
                "excludeByName": {"Time": True, "Value": True, "__name__": True},
                "indexByName": {"job": 0, "host": 1, "rank": 2, "instance": 3, "version": 4,
                                "transport": 5, "nsocks": 6, "algorithm": 7},
                "renameByName": {}})))
    d = d.with_panel(info.with_target(target("A", series("linerate_info"), "", instant=True)))

    return json.loads(json.dumps(d.build(), cls=s["JSONEncoder"]))


def render() -> str:
    """The dashboard file's text."""
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m linerate.tools.dev.dashboard",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", nargs="?", const=str(DEFAULT_PATH), metavar="PATH",
                    help=f"write the file (default {DEFAULT_PATH}) instead of printing it")
    ap.add_argument("--check", nargs="?", const=str(DEFAULT_PATH), metavar="PATH",
                    help="exit 1 if the file differs from the generator's output")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        same = Path(args.check).read_text() == text
        if not same:
            print(f"{args.check} differs from the generator's output; rewrite it with "
                  f"python -m linerate.tools.dev.dashboard --write", file=sys.stderr)
        return 0 if same else 1
    if args.write:
        Path(args.write).write_text(text)
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
