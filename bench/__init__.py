"""Benchmarks (scripts that print numbers) and their test support: `bench.simfleet`."""
