"""Throughput at saturation: a closed loop of C clients with no think time.

In process, on a virtual clock whose service times are measured for real (as the open-loop
simulation): each call takes every waiting request up to the token budget, and each client
sends its next request the moment its last one returns. Against the Ray Serve app, real
clients post over HTTP and the wall clock is the measure.
"""

from __future__ import annotations

import statistics
import time
import urllib.request
from collections import deque

import numpy as np
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from . import common


def _summary(latencies_ms: list[float], requests: int, tokens: int, seconds: float, batches: list[int]) -> dict:
    return {"throughput_rps": requests / seconds, "tokens_per_s": tokens / seconds,
            "p50_ms": float(np.percentile(latencies_ms, 50)), "p99_ms": float(np.percentile(latencies_ms, 99)),
            "mean_batch_requests": statistics.fmean(batches) if batches else None}


def closed_loop(run, pixels_for, grids, clients: int, max_tokens: int, device: torch.device) -> dict:
    """``clients`` closed-loop clients over the requests ``grids``, in process (virtual clock)."""
    n = len(grids)
    size = [t * h * w for t, h, w in grids]
    issued = min(clients, n)
    arrivals = [0.0] * issued
    waiting = deque(range(issued))
    done = [0.0] * n
    clock, batches = 0.0, []
    while waiting:
        batch, tokens = [waiting.popleft()], 0
        tokens = size[batch[0]]
        while waiting and tokens + size[waiting[0]] <= max_tokens:
            batch.append(waiting.popleft())
            tokens += size[batch[-1]]
        pixels = torch.cat([pixels_for(grids[i]) for i in batch])
        common.sync(device)
        start = time.perf_counter()
        run(pixels, [grids[i] for i in batch])
        common.sync(device)
        clock += time.perf_counter() - start
        batches.append(len(batch))
        for i in batch:
            done[i] = clock
            if issued < n:  # this client's next request
                arrivals.append(clock)
                waiting.append(issued)
                issued += 1
    return _summary([(done[i] - arrivals[i]) * 1e3 for i in range(n)], n, sum(size), clock, batches)


def _rows_payload(pixels: torch.Tensor, grid) -> bytes:
    """A ``POST /encode`` body of one item's rows (in their own dtype) and its grid."""
    return save_safetensors({"pixels": pixels.cpu().contiguous(), "grid_thw": torch.tensor([grid])})


def _post(url: str, body: bytes, what: str, content_type: str = "application/octet-stream") -> tuple[str, bytes]:
    """POST a rows payload (or a body of ``content_type``); returns (the replica that answered, the response body)."""
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": content_type})
    with urllib.request.urlopen(request, timeout=600) as response:
        if response.status != 200:
            raise RuntimeError(f"{what}: HTTP {response.status}")
        return response.headers["X-Vitgraph-Replica"], response.read()


def http_closed_loop(url: str, pixels_for, grids, clients: int) -> dict:
    """``clients`` threads posting the requests ``grids`` to the Ray Serve app (wall clock)."""
    # Rows in the encoder's dtype, as a serving stack that preprocesses into bf16 sends them.
    payloads = [_rows_payload(pixels_for(g), g) for g in grids]
    return _threaded_closed_loop(lambda i: _post(url, payloads[i], f"request {i}"), grids, clients)


def handle_closed_loop(handle, pixels_for, grids, clients: int) -> dict:
    """``clients`` threads calling the deployment's ``encode`` through a Python handle (the
    in-cluster interface: no HTTP, rows as tensors through Ray's object transfer)."""
    rows = [pixels_for(g).cpu().contiguous() for g in grids]

    def send(i: int) -> None:
        handle.encode.remote(rows[i], [grids[i]]).result()

    return _threaded_closed_loop(send, grids, clients)


def _threaded_closed_loop(send, grids, clients: int) -> dict:
    latencies, seconds = common.closed_loop(send, len(grids), clients)
    return _summary(latencies, len(grids), sum(t * h * w for t, h, w in grids), seconds, [])


def serve_agreement(url: str, encode, pixels_for, grids, repeats: int) -> dict:
    """Each of ``grids`` posted alone ``repeats`` times (one request at a time, so each is its
    own encode call) against ``encode`` in this process with the same weights: the largest
    difference per replica that answered (0.0: the same bits)."""
    worst: dict[str, float] = {}
    for grid in grids:
        expected = encode(pixels_for(grid), [grid]).float().cpu()
        for _ in range(repeats):
            replica, body = _post(url, _rows_payload(pixels_for(grid), grid), f"grid {grid}")
            got = load_safetensors(body)["embeddings"]
            worst[replica] = max(worst.get(replica, 0.0), (got.float() - expected).abs().max().item())
    return worst


def replica_stats(handle, replicas: int, tries: int = 64) -> dict[str, dict]:
    """Each replica's ``stats()``, asked through the handle until every
    replica has answered or ``tries`` run out."""
    found: dict[str, dict] = {}
    for _ in range(tries):
        stats = handle.stats.remote().result()
        found[stats["replica"]] = stats
        if len(found) >= replicas:
            break
    return found


def start_serve_app(args, port: int, max_budget: int, **app_options):
    """Ray and the vitgraph app on this machine, for ``--target serve``; returns (url, handle, stop).
    ``app_options``: more of :func:`vitgraph.serve.build_app`'s arguments (``max_pixels``...)."""
    import ray
    from ray import serve

    from ..serve import build_app

    def stop():
        serve.shutdown()
        ray.shutdown()

    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        handle = serve.run(build_app(args.model, preset=args.preset, device=args.device, dtype=args.dtype,
                                     num_replicas=args.replicas, num_gpus=args.gpus_per_replica,
                                     max_budget=max_budget, **app_options),
                           name="vitgraph-bench", route_prefix="/")
    except BaseException:  # a replica that cannot start: leave no Ray behind
        stop()
        raise
    return f"http://127.0.0.1:{port}/encode", handle, stop
