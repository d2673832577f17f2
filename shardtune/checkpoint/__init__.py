"""shardtune.checkpoint."""
