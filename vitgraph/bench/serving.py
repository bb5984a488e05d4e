"""Serving simulation: open-loop Poisson arrivals of realistic image/video requests, or a
closed loop at saturation.

    vitgraph bench-serving                 # qwen2-vl-2b random weights on GPU, tiny on CPU
    python benchmarks/serving.py --loads 10 25 50 --requests 300
    vitgraph bench-serving --closed-loop 8 32 --target serve   # throughput at saturation, also via Ray Serve

Requests arrive on a virtual clock (seeded Poisson process). An encoder loop takes
every queued request, up to the largest bucket's token budget, into one ``encode``
call; the call really runs on the device, synchronised, and the clock advances by
its measured duration. Latency is completion minus arrival. Reports p50/p90/p99
latency and throughput per system and load; prints a table; ``--json`` writes the results.
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import numpy as np
import torch
from tqdm.auto import tqdm

from ..engine import fit_budgets
from ..runtime.options import EngineOptions
from ..images.preprocess import MIN_PIXELS, smart_resize
from .. import cli_args
from . import common
from .args import serving_parser as build_parser

# (kind, width, height, frames, weight): photos, screenshots and short clips.
MIX = [
    ("thumbnail 224x224", 224, 224, 1, 0.15),
    ("photo 640x480", 640, 480, 1, 0.20),
    ("photo 1024x768", 1024, 768, 1, 0.15),
    ("video 720p frame 1280x720", 1280, 720, 1, 0.15),
    ("screenshot 1440x900", 1440, 900, 1, 0.10),
    ("phone screenshot 828x1792", 828, 1792, 1, 0.10),
    ("photo 1920x1080", 1920, 1080, 1, 0.05),
    ("clip 8 frames 448x448", 448, 448, 8, 0.05),
    ("clip 16 frames 336x252", 336, 252, 16, 0.05),
]


def request_grids(n: int, seed: int, max_pixels: int) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    weights = [m[-1] for m in MIX]
    grids = []
    for _ in range(n):
        _, w, h, frames, _ = rng.choices(MIX, weights)[0]
        rh, rw = smart_resize(h, w, 28, MIN_PIXELS, max_pixels)
        grids.append((max(1, frames // 2), rh // 14, rw // 14))
    return grids


def simulate(run, pixels_for, grids, arrivals, max_tokens, device) -> dict:
    """Discrete-event loop on a virtual clock; service times are measured for real."""
    n = len(grids)
    done = [0.0] * n
    clock, nxt = 0.0, 0
    busy = 0.0
    calls = []  # (ms, tokens, frames) of each encode call
    while nxt < n:
        clock = max(clock, arrivals[nxt])
        batch = [nxt]
        tokens = grids[nxt][0] * grids[nxt][1] * grids[nxt][2]
        nxt += 1
        while nxt < n and arrivals[nxt] <= clock:
            t = grids[nxt][0] * grids[nxt][1] * grids[nxt][2]
            if tokens + t > max_tokens:
                break
            batch.append(nxt)
            tokens += t
            nxt += 1
        batch_grids = [grids[i] for i in batch]
        pixels = torch.cat([pixels_for(grids[i]) for i in batch])
        common.sync(device)
        start = time.perf_counter()
        run(pixels, batch_grids)
        common.sync(device)
        took = time.perf_counter() - start
        busy += took
        clock += took
        calls.append((took * 1e3, tokens, sum(grids[i][0] for i in batch)))
        for i in batch:
            done[i] = clock
    latencies = sorted((done[i] - arrivals[i]) * 1e3 for i in range(n))

    def pct(p):
        return float(np.percentile(latencies, p))

    return {"p50_ms": pct(50), "p90_ms": pct(90), "p99_ms": pct(99), "mean_ms": statistics.fmean(latencies),
            "throughput_rps": n / max(done), "utilisation": busy / max(done),
            "slowest_calls": [{"ms": ms, "tokens": t, "frames": f} for ms, t, f in sorted(calls, reverse=True)[:3]]}


def medians_across_seeds(runs: list[dict]) -> list[dict]:
    """Per (load, system), in first-seen order: the median across request streams of each
    latency percentile and of the GPU's busy share."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["load_rps"], run["system"]), []).append(run)
    return [{"load_rps": load, "system": system, "streams": len(group),
             **{key: statistics.median(r[key] for r in group) for key in ("p50_ms", "p90_ms", "p99_ms", "utilisation")}}
            for (load, system), group in groups.items()]


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    on_gpu = cli_args.resolve_model_args(args)
    common.check_systems(parser, args.systems, on_gpu)
    loads = args.loads or ([5.0, 10.0, 20.0] if on_gpu else [0.5, 1.0])
    n = args.requests or (300 if on_gpu else 8)
    systems = args.systems or (["hf_eager", "vitgraph_eager", "vitgraph_graph"] if on_gpu
                               else ["hf_eager", "vitgraph_eager"])
    max_budget = 16384
    max_pixels = args.max_pixels if on_gpu else min(args.max_pixels, 200704)  # keep the CPU run short
    seeds = args.seeds or [args.seed]
    engine = _fitted_budgets(args.fit_budgets, seeds, max_pixels, max_budget) if args.fit_budgets else {}
    runners, eager_enc, _ = common.build_systems(args, systems, max_budget, **engine)
    device, dtype = eager_enc.device, eager_enc.dtype

    gen = torch.Generator().manual_seed(args.seed)
    cache: dict[tuple[int, int, int], torch.Tensor] = {}

    def pixels_for(grid):
        if grid not in cache:
            cache[grid] = torch.randn(grid[0] * grid[1] * grid[2], eager_enc.shape.patch_width,
                                      generator=gen).to(device, dtype)
        return cache[grid]

    result = {**common.environment(device), "preset": args.model or args.preset, "dtype": str(dtype)[6:],
              "requests_per_load": n, "max_pixels": max_pixels, "mix": [m[0] for m in MIX],
              "budgets": engine.get("budgets", "default ladder"), "seeds": seeds, "runs": []}
    streams = {seed: request_grids(n, seed, max_pixels) for seed in seeds}
    result["mean_tokens_per_request"] = statistics.fmean(t * h * w for g in streams.values() for t, h, w in g)
    result["check"] = _checked(runners, eager_enc, streams[seeds[0]][:6], pixels_for, dtype)
    for g in {g for grids in streams.values() for g in grids}:  # warm every shape and kernel first
        for run in runners.values():
            run(pixels_for(g), [g])
    if args.closed_loop:
        return _saturation(args, result, runners, systems, streams, pixels_for, max_budget, device)
    shown = [name for name in systems if name in runners]
    bar = tqdm(total=len(streams) * len(loads) * len(shown), desc="runs", unit="run", disable=None)  # a terminal's
    for seed, grids in streams.items():
        for load in loads:
            rng = np.random.default_rng(seed + int(load * 1000))
            arrivals = np.cumsum(rng.exponential(1.0 / load, size=n)).tolist()
            for name in systems:
                if name not in runners:
                    continue
                stats = simulate(runners[name], pixels_for, grids, arrivals, max_budget, device)
                result["runs"].append({"system": name, "load_rps": load, "seed": seed, **stats})
                slowest = ", ".join(f"{c['ms']:.1f} ms ({c['tokens']} tokens, {c['frames']} frames)"
                                    for c in stats["slowest_calls"])
                tqdm.write(f"  seed {seed} load {load:g}/s {name}: p50 {stats['p50_ms']:.1f} ms, p99 "
                           f"{stats['p99_ms']:.1f} ms; slowest calls {slowest}", file=sys.stderr)
                bar.update()
    bar.close()

    _print_runs(result, n, seeds)
    common.write_json(result, args.json)
    return result


def _fitted_budgets(count: int, seeds: list[int], max_pixels: int, max_budget: int) -> dict:
    """``{"budgets": ...}`` fitted to another sample of the mix (none of the measured streams)."""
    eager_above = EngineOptions().exact_eager_above  # single frames above it never replay
    sample = request_grids(2000, max(seeds) + 1, max_pixels)
    return {"budgets": fit_budgets([t * h * w for t, h, w in sample if t > 1 or h * w <= eager_above],
                                   count, max_budget)}


def _checked(runners: dict, eager_enc, probe: list, pixels_for, dtype) -> dict[str, float]:
    """Correctness first: every system on one mixed batch, against vitgraph_eager."""
    pixels = torch.cat([pixels_for(g) for g in probe])
    reference = eager_enc.encode(pixels, probe).float()
    check = {}
    for name, run in runners.items():
        check[name] = err = common.rel_err(run(pixels, probe).float(), reference)
        if not err <= (1e-4 if dtype == torch.float32 else 3e-2):
            raise SystemExit(f"{name}: output differs from vitgraph_eager (rel err {err:.3e})")
    return check


def _print_runs(result: dict, n: int, seeds: list[int]) -> None:
    print(f"\nserving: {result['preset']} {result['dtype']} on {result['machine']}, torch {result['torch']}, "
          f"{result['date']}; {n} requests per load, mean {result['mean_tokens_per_request']:.0f} patch tokens")
    common.print_table(["seed", "load/s", "system", "p50 ms", "p90 ms", "p99 ms", "req/s", "busy"],
                       [[r["seed"], r["load_rps"], r["system"], r["p50_ms"], r["p90_ms"], r["p99_ms"],
                         r["throughput_rps"], r["utilisation"]] for r in result["runs"]])
    if len(seeds) > 1:
        result["medians"] = medians_across_seeds(result["runs"])
        print(f"\nmedians across {len(seeds)} request streams (seeds {', '.join(map(str, seeds))}):")
        common.print_table(["load/s", "system", "p50 ms", "p90 ms", "p99 ms", "busy"],
                           [[m["load_rps"], m["system"], m["p50_ms"], m["p90_ms"], m["p99_ms"], m["utilisation"]]
                            for m in result["medians"]])


def _saturation(args, result, runners, systems, streams, pixels_for, max_budget, device) -> dict:
    """The closed-loop runs (``--closed-loop``): every system at every client count."""
    from . import saturation

    result["closed_loop"] = []
    url, handle, stop = (saturation.start_serve_app(args, args.port, max_budget) if args.target == "serve"
                         else (None, None, None))
    try:
        if url is not None:
            _check_replicas(args, result, runners, streams, pixels_for, url)
        for seed, grids in streams.items():
            for clients in args.closed_loop:
                for name, stats in _closed_loops(runners, systems, grids, clients, pixels_for, max_budget, device,
                                                 url, handle):
                    result["closed_loop"].append({"system": name, "clients": clients, "seed": seed, **stats})
        if handle is not None:
            result["replicas"] = saturation.replica_stats(handle, args.replicas)
            for name, stats in result["replicas"].items():
                print(f"  replica {name} on {stats['device']}: memory {stats['memory']}", file=sys.stderr)
    finally:
        if stop is not None:
            stop()
    _print_saturation(result)
    common.write_json(result, args.json)
    return result


def _check_replicas(args, result, runners, streams, pixels_for, url) -> None:
    """Every replica answers as this process's encoder does, before any load."""
    from . import saturation

    probe = list(dict.fromkeys(g for grids in streams.values() for g in grids))[:4]
    reference = runners.get("vitgraph_graph") or runners["vitgraph_eager"]
    result["serve_agreement"] = saturation.serve_agreement(url, reference, pixels_for, probe,
                                                           repeats=2 * args.replicas)
    print(f"  ray_serve agreement (max |difference| per replica): {result['serve_agreement']}", file=sys.stderr)


def _closed_loops(runners, systems, grids, clients, pixels_for, max_budget, device, url, handle) -> list:
    """``(system, stats)`` of one client count: each in-process system, then Ray over HTTP and
    through the handle (each after a warm-up of one request per client) where a Serve app runs."""
    from . import saturation

    rows = [(name, saturation.closed_loop(runners[name], pixels_for, grids, clients, max_budget, device))
            for name in systems if name in runners]
    if url is not None:
        saturation.http_closed_loop(url, pixels_for, grids[:clients], clients)
        rows.append(("ray_serve", saturation.http_closed_loop(url, pixels_for, grids, clients)))
        saturation.handle_closed_loop(handle, pixels_for, grids[:clients], clients)
        rows.append(("ray_handle", saturation.handle_closed_loop(handle, pixels_for, grids, clients)))
    return rows


def _print_saturation(result: dict) -> None:
    print(f"\nsaturation: {result['preset']} {result['dtype']} on {result['machine']}, {result['date']}; "
          f"{result['requests_per_load']} requests, mean {result['mean_tokens_per_request']:.0f} patch tokens")
    common.print_table(["seed", "clients", "system", "req/s", "patch tokens/s", "p50 ms", "p99 ms", "req/call"],
                       [[r["seed"], r["clients"], r["system"], r["throughput_rps"], r["tokens_per_s"], r["p50_ms"],
                         r["p99_ms"], r["mean_batch_requests"]] for r in result["closed_loop"]])


if __name__ == "__main__":
    main()
