"""Data: the embedded corpus, readers for user corpora, tokenizers, token shards, fetched assets."""
