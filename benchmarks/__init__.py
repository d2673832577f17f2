"""Reproducible shardtune benchmarks; results go to BENCHMARKS.md.

Each script (``state_dict``, ``checkpoint``, ``checksums``, ``io_choices``) defines its steps and tables;
``driver`` is what they share: command line, runs in fresh rank processes, report header and
writing the script's section of BENCHMARKS.md.
"""
