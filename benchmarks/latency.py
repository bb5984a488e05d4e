"""Latency suite; see vitgraph/bench/latency.py (also ``vitgraph bench``)."""

from vitgraph.bench.latency import main

if __name__ == "__main__":
    main()
