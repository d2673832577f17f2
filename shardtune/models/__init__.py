"""shardtune.models."""
