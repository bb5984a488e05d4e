"""PNG decoding on the host: vitgraph's decode of each PNG of ``vitgraph bench-images --formats``
(``load_pixels``, transparency kept for the device) by PIL against libspng (the ``png`` extra),
one thread and ``--threads`` threads over the same files. Needs no GPU.

    python benchmarks/png_decode.py --json out/png-decode.json

Per format and decoder: median ms of one decode, and images/s with the threads (PIL and libspng
both release the GIL while they decode); the two decoders' pixels are checked equal first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from vitgraph.bench.image_formats import FORMATS, make_samples
from vitgraph.images import png
from vitgraph.images.decode import decode_pil, keep_alpha, load_pixels


def decoders() -> dict:
    """vitgraph's two ways to decode a PNG for the device (transparency kept): PIL, and with the
    png extra, libspng (where the PNG is plain; these are)."""
    if png.spng_decode() is None:
        raise SystemExit("needs imagecodecs (pip install -e '.[png]')")
    return {"pil": lambda blob: np.asarray(decode_pil(blob, "image", convert=keep_alpha)),
            "libspng": lambda blob: load_pixels(blob, "image", alpha=True)}


def time_one(blob: bytes, decode, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        decode(blob)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def images_per_s(blob: bytes, decode, threads: int, count: int) -> float:
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda _: decode(blob), range(threads)))
        start = time.perf_counter()
        list(pool.map(lambda _: decode(blob), range(count)))
        return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    pngs = [f for f in FORMATS if f[3].get("format") == "PNG"]
    rows = []
    for sample in make_samples(0, pngs):
        blob, ways = sample["item"], decoders()
        assert png.plain_channels(blob) and np.array_equal(ways["pil"](blob), ways["libspng"](blob)), sample["format"]
        for name, decode in ways.items():
            row = {"format": sample["format"], "size": sample["size"], "bytes": len(blob), "decoder": name,
                   "ms": time_one(blob, decode, args.repeats), "threads": args.threads,
                   "images_per_s_1": images_per_s(blob, decode, 1, args.repeats),
                   "images_per_s_n": images_per_s(blob, decode, args.threads, args.repeats * args.threads)}
            rows.append(row)
            print(f"{row['format']:28} {row['size']:9} {name:8} {row['ms']:6.2f} ms  "
                  f"{row['images_per_s_1']:6.0f} img/s, {row['images_per_s_n']:6.0f} with {args.threads} threads")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu_count": os.cpu_count(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
