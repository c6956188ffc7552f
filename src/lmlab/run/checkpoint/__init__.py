"""Checkpoints and the run directory: local (safetensors) and sharded (DCP) layouts, lock, atomic writes."""
