"""Data for distributed training: world-size independent, resumable samplers for any map-style
dataset, and the built-in corpus (Python's own standard library source)."""
