"""shardtune.data."""
