"""OpenAI-compatible HTTP server over the paged decode engine (``python -m minimax_jax.serve``).

Modules (one job each): ``protocol`` (pydantic request models, OpenAI-style errors), ``scheduler``
(continuous batching in one worker thread), ``responses`` (response bodies and stream chunks),
``metrics`` (Prometheus text), ``app`` (FastAPI routes), ``server`` (assembly), ``cli`` (flags,
``main(argv)``).
A runtime: imports infer / decode / chat / model / config; nothing imports it but CLIs.
"""
