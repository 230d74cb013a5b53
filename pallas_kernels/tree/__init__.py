"""Prefix-tree attention kernels (``gpu_attention``: Triton-lowered forward and backward)."""
