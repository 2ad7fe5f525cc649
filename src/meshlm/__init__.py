"""meshlm: recursive Transformers with MeSH."""
