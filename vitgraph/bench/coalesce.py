"""Concurrent callers, one JPEG a request: one ``encode_images`` call per request against the
coalescing front (``submit_images``) and the ceiling, the same requests grouped by hand.

    vitgraph bench-coalesce --json out/coalesce.json
    vitgraph bench-coalesce --presets qwen2-vl-2b --traffic thumbs --callers 1 32

Traffic (seeded JPEGs, quality 90, smooth fields and grain): ``thumbs`` 112x112 to 256x256,
``small`` 112x112 to 640x480, ``large`` 1280x720 to 1920x1080. For each preset, traffic and
caller count C, a closed loop of C threads, each sending its next request when its last is
answered (a request is answered when its embeddings are complete on the device):

* ``per_call``: ``encoder.encode_images([jpeg])`` and a sync of the caller's stream;
* ``coalesced``: ``encoder.submit_images([jpeg]).result()``;
* ``grouped`` (one caller, C = 1): the same requests 16 to an ``encode_images`` call; each
  request's latency is its call's.

With ``--serve``, also ``vitgraph serve`` (Ray Serve, one replica) on the same traffic, after
the in-process runs: ``serve_http`` (``POST /encode``, the JPEG as a multipart file) and
``serve_handle`` (``handle.encode_images.remote([jpeg])``), both answered on the CPU.

Images/s and p50/p99 ms per request. For ``grouped``, the share of its wall time the GPU is
busy (kernels and copies, from torch.profiler). For ``coalesced``, the front's requests per
batch and queue wait, and the plan cache's hits, misses and host ms per miss.
"""

from __future__ import annotations

import argparse
import gc
import io
import sys
import time

import numpy as np
import torch
from PIL import Image

from .. import GraphedVisionEncoder
from . import common
from .args import MODES, TRAFFIC, coalesce_parser as build_parser

SERVE_MODES = ("serve_http", "serve_handle")
GROUP = 16


def make_traffic(name: str, count: int, seed: int) -> list[bytes]:
    (w0, w1), (h0, h1) = TRAFFIC[name]
    rng = np.random.default_rng(seed)
    blobs = []
    for _ in range(count):
        w, h = int(rng.integers(w0, w1 + 1)), int(rng.integers(h0, h1 + 1))
        coarse = rng.integers(0, 256, (max(h // 48, 2), max(w // 48, 2), 3), dtype=np.uint8)
        base = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BICUBIC)).astype(np.int16)
        pixels = np.clip(base + rng.integers(-12, 13, (h, w, 3)), 0, 255).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
        blobs.append(buffer.getvalue())
    return blobs


def closed_loop(send, blobs: list[bytes], callers: int, requests: int) -> dict:
    """``callers`` threads sending ``requests`` requests (image ``i % len(blobs)``) back to back."""
    latencies, wall = common.closed_loop(lambda i: send(blobs[i % len(blobs)]), requests, callers)
    return _rates(latencies, requests, wall)


def grouped(enc, blobs: list[bytes], requests: int) -> dict:
    """One caller, ``GROUP`` requests to a call; each request's latency is its call's."""
    latencies = []
    start = time.perf_counter()
    for first in range(0, requests, GROUP):
        group = [blobs[i % len(blobs)] for i in range(first, min(first + GROUP, requests))]
        t0 = time.perf_counter()
        enc.encode_images(group)
        _stream_sync(enc)
        latencies += [(time.perf_counter() - t0) * 1e3] * len(group)
    return _rates(latencies, requests, time.perf_counter() - start)


def _rates(latencies_ms: list[float], requests: int, wall: float) -> dict:
    return {"images_per_s": requests / wall, "p50_ms": float(np.percentile(latencies_ms, 50)),
            "p99_ms": float(np.percentile(latencies_ms, 99)), "requests": requests, "seconds": wall}


def _stream_sync(enc) -> None:
    """The caller's stream done (not the device: other callers' work may still run)."""
    if enc.device.type == "cuda":
        torch.cuda.current_stream(enc.device).synchronize()


def gpu_busy(enc, blobs: list[bytes], groups: int) -> float | None:
    """The share of the grouped loop's span in which the GPU runs a kernel or a copy (torch.profiler)."""
    if enc.device.type != "cuda":
        return None
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            grouped(enc, blobs, groups * GROUP)
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    except Exception as err:  # the profiler's API differs between torch versions
        print(f"bench-coalesce: no GPU-busy share ({type(err).__name__}: {err})", file=sys.stderr)
        return None
    if not spans:
        return None
    busy, (lo, hi) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > hi:
            busy, lo, hi = busy + hi - lo, s, e
        else:
            hi = max(hi, e)
    busy += hi - lo
    return busy / (spans[-1][1] - spans[0][0]) if len(spans) else None


def senders(enc) -> dict:
    def per_call(blob):
        enc.encode_images([blob])
        _stream_sync(enc)

    def coalesced(blob):
        enc.submit_images([blob]).result(timeout=300)

    return {"per_call": per_call, "coalesced": coalesced}


def requests_for(traffic: str, callers: int, scale: float) -> int:
    base = {"thumbs": 512, "small": 384, "large": 64}[traffic]
    return max(int(base * scale), 2 * callers, GROUP)


def run_preset(args, preset: str, cases: list, extra: dict) -> None:
    enc = GraphedVisionEncoder.from_config(preset, progress=False, max_wait_ms=args.max_wait_ms,
                                           front_threads=args.front_threads)
    try:
        for traffic in args.traffic:
            blobs = make_traffic(traffic, args.images, args.seed)
            for blob in blobs:  # warm-up: every image once, both paths
                enc.encode_images([blob])
                enc.submit_images([blob]).result(timeout=300)
            if "grouped" in args.modes:
                enc.encode_images(blobs[:GROUP])
                stats = grouped(enc, blobs, requests_for(traffic, GROUP, args.scale))
                stats["gpu_busy"] = gpu_busy(enc, blobs, groups=8)
                cases.append({"model": preset, "traffic": traffic, "callers": 1, "mode": "grouped", **stats})
                _report(cases[-1])
            send = senders(enc)
            for callers in args.callers:
                for mode in [m for m in ("per_call", "coalesced") if m in args.modes]:
                    n = requests_for(traffic, callers, args.scale)
                    closed_loop(send[mode], blobs, callers, min(n, 2 * callers))  # warm-up at this load
                    if enc._front is not None:  # queue-wait percentiles of this case alone
                        enc._front._counters.waits_ms.clear()
                    before = enc.stats()
                    stats = closed_loop(send[mode], blobs, callers, n)
                    after = enc.stats()
                    case = {"model": preset, "traffic": traffic, "callers": callers, "mode": mode, **stats,
                            "front_threads": enc.stats()["front"]["front_threads"]}
                    if mode == "coalesced":
                        case.update(_front_delta(before, after))
                    cases.append(case)
                    _report(case)
        for wait_ms in args.wait_sweep:  # the default's choice: the same front with other waits
            sweep = GraphedVisionEncoder.from_config(preset, progress=False, max_wait_ms=wait_ms)
            try:
                blobs = make_traffic("thumbs", args.images, args.seed)
                for blob in blobs:
                    sweep.submit_images([blob]).result(timeout=300)
                for callers in (1, 8, 32):
                    n = requests_for("thumbs", callers, args.scale)
                    closed_loop(senders(sweep)["coalesced"], blobs, callers, min(n, 2 * callers))
                    stats = closed_loop(senders(sweep)["coalesced"], blobs, callers, n)
                    extra.setdefault("wait_sweep", []).append({"model": preset, "traffic": "thumbs",
                                                               "max_wait_ms": wait_ms, "callers": callers, **stats})
                    print(f"  wait sweep {preset} max_wait_ms={wait_ms} C={callers}: "
                          f"{stats['images_per_s']:.1f} img/s, p99 {stats['p99_ms']:.2f} ms", file=sys.stderr)
            finally:
                sweep.close()
                del sweep
    finally:
        enc.close()
        del enc
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.serve:
        run_serve(args, preset, cases)


def run_serve(args, preset: str, cases: list) -> None:
    """The Ray Serve app (one replica, this machine's GPU) on the same traffic and callers."""
    from . import images_serve, saturation

    app = argparse.Namespace(model=None, preset=preset, device=None, dtype=None, replicas=1, gpus_per_replica=None)
    url, handle, stop = saturation.start_serve_app(app, args.port, 16384, max_wait_ms=args.max_wait_ms)
    try:
        for traffic in args.traffic:
            blobs = make_traffic(traffic, args.images, args.seed)
            forms = [images_serve.multipart(blob) for blob in blobs]
            index = {blob: i for i, blob in enumerate(blobs)}

            def http(blob):
                body, kind = forms[index[blob]]
                saturation._post(url, body, "image", kind)

            def by_handle(blob):
                handle.encode_images.remote([blob]).result(timeout_s=300)

            for blob in blobs:  # warm-up, every image once
                http(blob)
            for callers in args.callers:
                for mode, send in (("serve_http", http), ("serve_handle", by_handle)):
                    n = requests_for(traffic, callers, args.scale)
                    closed_loop(send, blobs, callers, min(n, 2 * callers))
                    cases.append({"model": preset, "traffic": traffic, "callers": callers, "mode": mode,
                                  **closed_loop(send, blobs, callers, n)})
                    _report(cases[-1])
    finally:
        stop()


def _front_delta(before: dict, after: dict) -> dict:
    f0, f1 = before["front"], after["front"]
    p0, p1 = before["plans"], after["plans"]
    batches = f1.get("batches", 0) - f0.get("batches", 0)
    misses = p1["misses"] - p0["misses"]
    miss_s = p1["miss_ms"] * p1["misses"] - p0["miss_ms"] * p0["misses"]
    return {"requests_per_batch": (f1["requests"] - f0["requests"]) / batches if batches else None,
            "queue_wait_p50_ms": f1["queue_wait_ms"]["p50"], "queue_wait_p99_ms": f1["queue_wait_ms"]["p99"],
            "plan_hits": p1["hits"] - p0["hits"], "plan_misses": misses,
            "plan_miss_ms": miss_s / misses if misses else None}


def _report(case: dict) -> None:
    more = f", {case['requests_per_batch']:.1f} req/batch" if case.get("requests_per_batch") else ""
    busy = f", GPU busy {case['gpu_busy']:.0%}" if case.get("gpu_busy") is not None else ""
    print(f"  {case['model']} {case['traffic']} C={case['callers']} {case['mode']}: {case['images_per_s']:.1f} img/s, "
          f"p50 {case['p50_ms']:.2f} ms, p99 {case['p99_ms']:.2f} ms{more}{busy}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.from_json:
        import json

        cases = [c for path in args.from_json for c in json.loads(open(path).read())["cases"]]
        _print(cases)
        if args.plot:
            plot(cases, args.plot)
        return 0
    presets = args.presets or (["qwen2-vl-2b", "qwen3-vl-8b"] if torch.cuda.is_available() else ["tiny"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cases: list[dict] = []
    extra: dict = {}
    for i, preset in enumerate(presets):
        sweep = args.wait_sweep if i == 0 else []
        run_preset(argparse.Namespace(**{**vars(args), "wait_sweep": sweep}), preset, cases, extra)
    env = common.environment(device)
    result = {"gpu": env["machine"], "environment": env, "cases": cases, **extra}
    common.write_json(result, args.json)
    _print(cases)
    if args.plot:
        plot(cases, args.plot)
    return 0


def plot(cases: list[dict], path: str) -> None:
    """Images/s against callers, one panel per model and traffic; ``grouped`` as a line."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install vitgraph[bench])", file=sys.stderr)
        return
    panels = sorted({(c["model"], c["traffic"]) for c in cases}, key=lambda k: (k[0], list(TRAFFIC).index(k[1])))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2), squeeze=False)
    for ax, (model, traffic) in zip(axes[0], panels):
        mine = [c for c in cases if (c["model"], c["traffic"]) == (model, traffic)]
        for mode in [m for m in MODES + SERVE_MODES if m != "grouped"]:
            points = sorted((c["callers"], c["images_per_s"]) for c in mine if c["mode"] == mode)
            if points:
                ax.plot(*zip(*points), marker="o", label=mode)
        for c in mine:
            if c["mode"] == "grouped":
                ax.axhline(c["images_per_s"], color="black", linestyle="--", label="grouped (16 a call)")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{model}, {traffic}", fontsize=9)
        ax.set_xlabel("callers")
    axes[0][0].set_ylabel("images/s")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _print(cases: list[dict]) -> None:
    grouped_rate = {(c["model"], c["traffic"]): c["images_per_s"] for c in cases if c["mode"] == "grouped"}
    per_call = {(c["model"], c["traffic"], c["callers"]): c["images_per_s"] for c in cases if c["mode"] == "per_call"}
    coalesced = {(c["model"], c["traffic"], c["callers"]): c["images_per_s"] for c in cases if c["mode"] == "coalesced"}
    rows = []
    for c in cases:
        key = (c["model"], c["traffic"])
        rows.append([c["model"], c["traffic"], c["callers"], c["mode"], c["images_per_s"], c["p50_ms"], c["p99_ms"],
                     c["images_per_s"] / grouped_rate[key] if key in grouped_rate else None,
                     c["images_per_s"] / per_call[key + (c["callers"],)] if key + (c["callers"],) in per_call else None,
                     c["images_per_s"] / coalesced[key + (c["callers"],)] if key + (c["callers"],) in coalesced
                     else None, c.get("requests_per_batch"), c.get("gpu_busy")])
    common.print_table(["model", "traffic", "C", "mode", "img/s", "p50 ms", "p99 ms", "/grouped", "/per_call",
                        "/coalesced", "req/batch", "gpu busy"], rows)


if __name__ == "__main__":
    sys.exit(main())
