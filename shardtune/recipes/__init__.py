"""shardtune.recipes."""
