"""Benchmarks behind ``fedsec bench``: each prints one JSON object per line."""
