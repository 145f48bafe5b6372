"""Development drivers, not user commands: ``python -m linerate.tools.dev.<name>``.

fuzz (hypothesis against the transport's parsers), soak (long random op mixes against Gloo),
decent_bench, neighbor_bench, priority_bench, scale_bench and metrics_overhead (research
benchmarks), perf_report (runs the benchmarks and rewrites docs/performance.md).
"""
