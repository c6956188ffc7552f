"""Several processes: the process group and timeouts, the DDP/FSDP2 plan, experts, compile."""
