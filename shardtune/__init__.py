"""shardtune: distributed fine-tuning of LLMs with FSDP2 and memory-bounded checkpoints."""

__version__ = "0.1.0"
