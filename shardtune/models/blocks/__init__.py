"""The blocks decoder layers are built from: attention kinds, feed-forward kinds, routers, experts, norms.

Rule: one kind per module, its rule at its top; ``kinds.py`` is the registry a family's spec
(``shardtune.models.spec``) names them in. Blocks know nothing of families: a spec's options reach
them as arguments.
"""
