"""A custom serving loop: request threads hand in images, one encoder thread batches
whatever is queued (up to a token budget) into a single ``encode`` call.

    python examples/serving_loop.py                     # random weights (tiny on CPU, 2B shape on GPU)
    python examples/serving_loop.py --model Qwen/Qwen2-VL-2B-Instruct
"""

from __future__ import annotations

import argparse
import queue
import threading
from concurrent.futures import Future

import numpy as np
import torch

from vitgraph import GraphedVisionEncoder, preprocess_images

_STOP = object()


class EmbeddingServer:
    """Batches requests from many threads into one encode call per loop turn."""

    def __init__(self, encoder: GraphedVisionEncoder, max_tokens: int = 16384) -> None:
        self.encoder = encoder
        self.max_tokens = max_tokens
        self.requests: queue.Queue = queue.Queue()
        self.worker = threading.Thread(target=self._loop, daemon=True)
        self.worker.start()

    def submit(self, image) -> Future:
        """Preprocess on the caller's thread; the encoder thread only runs the model."""
        pixels, grid = preprocess_images([image])
        future: Future = Future()
        self.requests.put((pixels, grid, future))
        return future

    def close(self) -> None:
        self.requests.put(_STOP)
        self.worker.join()

    @staticmethod
    def _tokens(request) -> int:
        return int(request[1].prod(dim=1).sum())

    def _loop(self) -> None:
        carried = None  # a request that did not fit the previous batch
        while True:
            first = carried if carried is not None else self.requests.get()
            carried = None
            if first is _STOP:
                return
            batch, tokens = [first], self._tokens(first)
            while True:  # take whatever else is queued, up to the budget
                try:
                    item = self.requests.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP or tokens + self._tokens(item) > self.max_tokens:
                    carried = item
                    break
                batch.append(item)
                tokens += self._tokens(item)
            self._serve(batch)

    def _serve(self, batch) -> None:
        try:
            pixels = torch.cat([p for p, _, _ in batch])
            grid = torch.cat([g for _, g, _ in batch])
            rows = [self._tokens(request) // self.encoder.config.merge_unit for request in batch]
            for (_, _, future), embedding in zip(batch, self.encoder.encode(pixels, grid).split(rows)):
                future.set_result(embedding)
        except Exception as err:  # every waiting caller hears about it
            for _, _, future in batch:
                future.set_exception(err)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory or Hub repo id (default: random weights)")
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    if args.model:
        encoder = GraphedVisionEncoder.from_pretrained(args.model)
    else:
        encoder = GraphedVisionEncoder.from_config("qwen2-vl-2b" if torch.cuda.is_available() else "tiny")
    server = EmbeddingServer(encoder)
    rng = np.random.default_rng(0)
    sizes = [(224, 224), (480, 640), (720, 1280), (900, 1440)]
    images = [rng.integers(0, 256, (*sizes[i % len(sizes)], 3), dtype=np.uint8) for i in range(args.requests)]
    futures = []
    threads = [threading.Thread(target=lambda im=im: futures.append(server.submit(im))) for im in images]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    shapes = [tuple(f.result().shape) for f in futures]
    server.close()
    print(f"{len(shapes)} requests served; first shapes {shapes[:4]}; stats {encoder.stats()['buckets'] or 'eager'}")


if __name__ == "__main__":
    main()
