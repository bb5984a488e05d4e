"""Benchmarks shipped with vitgraph: ``latency`` (one call) and ``serving`` (Poisson arrivals)."""
