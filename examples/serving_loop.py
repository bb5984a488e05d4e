"""Many request threads, one encoder: each thread hands in its image with ``submit_images`` and
waits on the future; the encoder's front merges the requests that arrive together into shared
replays (no batching by hand).

    python examples/serving_loop.py                     # random weights (tiny on CPU, 2B shape on GPU)
    python examples/serving_loop.py --model Qwen/Qwen2-VL-2B-Instruct
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from vitgraph import GraphedVisionEncoder


def serve_requests(encoder: GraphedVisionEncoder, images: list, threads: int = 16) -> list[torch.Tensor]:
    """One request per image, from ``threads`` threads at once: each its own embeddings."""
    with ThreadPoolExecutor(threads) as callers:
        return list(callers.map(lambda image: encoder.submit_images([image]).result()[0], images))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory or Hub repo id (default: random weights)")
    parser.add_argument("--requests", type=int, default=64)
    args = parser.parse_args()
    if args.model:
        encoder = GraphedVisionEncoder.from_pretrained(args.model)
    else:
        encoder = GraphedVisionEncoder.from_config("qwen2-vl-2b" if torch.cuda.is_available() else "tiny")
    rng = np.random.default_rng(0)
    sizes = [(224, 224), (480, 640), (160, 200), (720, 1280)]
    images = [rng.integers(0, 256, (*sizes[i % len(sizes)], 3), dtype=np.uint8) for i in range(args.requests)]
    with encoder:  # close(): the front's threads end with the block
        embeddings = serve_requests(encoder, images)
    front = encoder.stats()["front"]
    print(f"{len(embeddings)} requests served in {front['batches']} batches "
          f"({front['requests_per_batch']:.1f} requests each, queue wait p99 {front['queue_wait_ms']['p99']:.1f} ms); "
          f"first shapes {[tuple(e.shape) for e in embeddings[:4]]}")


if __name__ == "__main__":
    main()
