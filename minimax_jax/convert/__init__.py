"""Checkpoint conversion between published safetensors (BF16 / FP8 block-scaled) and orbax."""
