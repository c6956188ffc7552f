"""Prepared data: config, sources, shards, tokenizers, and which data a run binds to."""
