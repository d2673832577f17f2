"""Bundled recipe configs (``<name>.yaml``, e.g. ``tiny/lora``) and the recipe config schemas."""
