"""shardtune.peft."""
