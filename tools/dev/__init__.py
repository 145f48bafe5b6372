"""Development drivers, not user commands: ``python -m linerate.tools.dev.<name>``.

fuzz (hypothesis against the transport's parsers), soak (long random op mixes against Gloo),
decent_bench, neighbor_bench, priority_bench and metrics_overhead (the research benchmarks
behind the README's figures).
"""
