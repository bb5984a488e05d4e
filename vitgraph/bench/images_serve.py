"""``vitgraph bench-images --serve``: the same JPEGs through ``vitgraph serve`` (the Ray Serve
app, one replica, started on this machine) at saturation, against the same images sent as rows.

Four closed loops per client count C, each after a warm-up of one request per client, over the
saturation image list (one image per request, so requests/s are images/s):

* ``serve_jpeg_http``: ``POST /encode`` with the JPEG as a multipart/form-data file (the body
  built here by hand, sent with urllib); the replica decodes and preprocesses it;
* ``serve_jpeg_handle``: ``handle.encode_images.remote([jpeg])``;
* ``serve_rows_http``: the image already preprocessed by the client (before the loop, with the
  encoder's own ``image_rows``: uint8 rows and grid) posted as a safetensors body;
* ``serve_rows_handle``: ``handle.encode.remote(rows, [grid])``.

Before any load, each mode's answer for each distinct image must have as many rows as this
process's ``encode_images`` gives for it (shape only: dtypes and paths may differ in bits).
"""

from __future__ import annotations

import argparse
import sys
import uuid

from safetensors.torch import load as load_safetensors

from . import common, saturation

MODES = ("serve_jpeg_http", "serve_jpeg_handle", "serve_rows_http", "serve_rows_handle")


def multipart(blob: bytes, name: str = "image.jpg") -> tuple[bytes, str]:
    """A multipart/form-data body holding ``blob`` as one JPEG file, and its Content-Type."""
    boundary = f"vitgraph-{uuid.uuid4().hex}"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"images\"; filename=\"{name}\"\r\n"
            "Content-Type: image/jpeg\r\n\r\n").encode()
    return head + blob + f"\r\n--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def senders(url: str, handle, blobs: list[bytes], rows: list, grids: list) -> dict:
    """Per mode, ``send(i)``: image ``i`` of ``blobs`` through that mode; returns the answer's rows."""
    forms = [multipart(blob) for blob in blobs]
    payloads = [saturation._rows_payload(r, g) for r, g in zip(rows, grids)]

    def embeddings_rows(body: bytes) -> int:
        return load_safetensors(body)["embeddings"].shape[0]

    def jpeg_http(i: int) -> int:
        return embeddings_rows(saturation._post(url, forms[i][0], f"image {i}", forms[i][1])[1])

    def jpeg_handle(i: int) -> int:
        answer = handle.encode_images.remote([blobs[i]]).result()
        if len(answer) != 1:
            raise RuntimeError(f"serve_jpeg_handle: {len(answer)} tensors for one image")
        return answer[0].shape[0]

    def rows_http(i: int) -> int:
        return embeddings_rows(saturation._post(url, payloads[i], f"rows of image {i}")[1])

    def rows_handle(i: int) -> int:
        return handle.encode.remote(rows[i], [grids[i]]).result().shape[0]

    return dict(zip(MODES, (jpeg_http, jpeg_handle, rows_http, rows_handle)))


def _loop(send, order: list[int], grids: list, clients: int) -> dict:
    """A closed loop of ``clients`` over the images ``order`` indexes, after one request per client."""
    loop_grids = [grids[j] for j in order]
    saturation._threaded_closed_loop(lambda i: send(order[i]), loop_grids[:clients], clients)  # warm-up
    return saturation._threaded_closed_loop(lambda i: send(order[i]), loop_grids, clients)


def run(args, enc, blobs: list[bytes], low: int, high: int) -> dict:
    """``{mode: {str(C): summary}}`` (``throughput_rps`` is images/s, ``p50_ms``, ``p99_ms``...)
    of the Serve app on ``blobs`` cycled to ``args.saturation_images`` images."""
    rows, grids = [], []
    for blob in blobs:  # the client's own preprocessing, done before any loop
        r, g = enc.image_rows([blob], min_pixels=low, max_pixels=high)
        rows.append(r.cpu().contiguous())
        grids.append(tuple(g[0].tolist()))
    expected = [enc.encode_images([blob], min_pixels=low, max_pixels=high)[0].shape[0] for blob in blobs]
    order = [i % len(blobs) for i in range(args.saturation_images)]
    app_args = argparse.Namespace(**vars(args), replicas=1, gpus_per_replica=None)  # one replica, one GPU
    print(f"bench-images: starting the Ray Serve app (one replica) on port {args.port}", file=sys.stderr)
    url, handle, stop = saturation.start_serve_app(app_args, args.port, enc.options.max_budget,
                                                   min_pixels=low, max_pixels=high)
    result: dict = {name: {} for name in MODES}
    try:
        modes = senders(url, handle, blobs, rows, grids)
        for name, send in modes.items():  # a broken path fails here, not as a timing
            for i, want in enumerate(expected):
                got = send(i)
                if got != want:
                    raise SystemExit(f"bench-images: {name} answered {got} rows for image {i}, "
                                     f"encode_images gives {want}")
        for clients in args.concurrency:
            for name, send in modes.items():
                result[name][str(clients)] = stats = _loop(send, order, grids, clients)
                print(f"  {name} C={clients}: {stats['throughput_rps']:.1f} images/s, p50 {stats['p50_ms']:.1f} ms",
                      file=sys.stderr)
    finally:
        stop()
    return result


def print_table(serve: dict) -> None:
    print("\nvitgraph serve (Ray Serve, one replica), images/s and latency with C closed-loop clients:")
    common.print_table(["system", "C", "images/s", "p50 ms", "p99 ms"],
                       [[name, c, s["throughput_rps"], s["p50_ms"], s["p99_ms"]]
                        for name, by_c in serve.items() for c, s in by_c.items()])
