"""Parallelism beyond GSPMD annotations: expert parallelism in ``shard_map`` (``expert``)."""
