"""Benchmarks of flashcpp against its peers, in one process: `python -m flashcpp.bench AREA`."""
