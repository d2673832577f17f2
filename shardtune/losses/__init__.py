"""Every training loss: the chunked language-model losses, the losses of each kind of training, and the
loop's loss function built from them.

Rule: a loss never makes full ``[tokens, vocab]`` logits in training and never makes the host wait for the
device. From the bottom up:

* ``linear_cross_entropy.py``, ``chunked.py``: cross-entropy and distillation from hidden states and a
  head, chunk by chunk (the models' ``head_loss`` calls them); ``logits.py``, ``preference.py``: losses from
  full logits and from per-sequence log-probs;
* ``rows.py``: a micro-batch as a loss sees it, whole or split over a context-parallel group (the one
  place a batch is split and per-row values are summed over the group);
* ``step.py``: the loop's ``loss_fn`` from a kind's loss (a mixture-of-experts load-balancing loss added);
* one module per kind: ``next_token.py``, ``distillation.py``, ``early_exit.py``, ``dpo.py``;
* ``from_config.py``: the one place a loss reads the config.

Policy-gradient losses (GRPO) live in :mod:`shardtune.rl`. The package imports none of its modules here:
``models`` uses ``linear_cross_entropy`` while ``rows`` uses ``models``.
"""
