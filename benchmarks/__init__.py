"""Reproducible shardtune benchmarks; results go to BENCHMARKS.md (see DESIGN.md §7)."""
