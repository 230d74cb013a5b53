"""Data: offline corpus builder, tokenizer training, grain input pipeline.

Modules: ``sources`` (text documents from files/JSONL/array_record), ``prose`` (Shakespeare and
stdlib text), ``corpus`` (JSONL shards), ``tokenizer`` (byte-level BPE with MiniMax special tokens),
``pipeline`` (packing, batching, checkpointable iterator).
"""
