"""Reproducible shardtune benchmarks; results go to BENCHMARKS.md."""
