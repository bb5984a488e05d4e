"""Serving simulation; see vitgraph/bench/serving.py (also ``vitgraph bench-serving``)."""

from vitgraph.bench.serving import main

if __name__ == "__main__":
    main()
