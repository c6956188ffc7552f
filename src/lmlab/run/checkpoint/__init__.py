"""Checkpoints and the run directory: the Checkpointer (checkpointer.py) over the local (safetensors) and
sharded (DCP) layouts, the run directory, its lock, atomic writes."""
