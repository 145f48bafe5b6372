"""Development drivers, not user commands: ``python -m linerate.tools.dev.<name>``.

fuzz (hypothesis against the transport's parsers), soak (long random op mixes against Gloo),
decent_bench, neighbor_bench, priority_bench, scale_bench and metrics_overhead (research
benchmarks), latency_bench (small-op cost against Gloo and Open MPI), perf_report (runs the
benchmarks and rewrites docs/performance.md), gpu_check (the one command a GPU host runs; its
--cpu mode runs anywhere), dashboard (generates the Grafana dashboard).
"""
