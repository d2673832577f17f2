"""Bundled recipe configs (``<name>.yaml``, e.g. ``tiny/lora``); their schemas are in ``shardtune.recipes.schemas``."""
