"""Reproducible shardtune benchmarks; results go to BENCHMARKS.md.

A *script* is a module without a leading underscore (``python -m benchmarks.train``): its command
line, the steps it runs inside rank processes and its tables. A *helper* is an underscore module;
nothing imports a script (``tests/unit/test_benchmark_layout.py``), so what two scripts share lives
in a helper, once:

* ``_driver``: command line, runs in fresh rank processes, report header, BENCHMARKS.md sections;
  ``_measure``: one timed step's time and memory, and the rank processes (``spawn_ranks``);
  ``_report``: sizes, byte formatting and per-method summaries;
* ``_fixtures``: state-only Llama fixtures (a bare module tree, random safetensors, the
  checkpoint benchmarks' HF directory); ``_hf_models``: the seeded HF models the training,
  streaming and GRPO benchmarks load, and their shapes;
* ``_train_step``: one training step built and measured the same way by every training benchmark;
  ``_step_profile``, ``_comm_bytes``, ``_torchtune_peer``: its profile, collective bytes and peer;
* a script's own parts, named after it: ``_<script>_steps`` (rank-side steps), ``_<script>_report``
  and ``_<script>_ep`` (tables).
"""
