"""Shared pieces of the benchmarks: systems under test, timing, ceilings, the cost model, output."""

from __future__ import annotations

import datetime
import json
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch

from ..runtime.encoder import GraphedVisionEncoder
from ..cli_args import make_encoder
from ..models import transformers_tower

Grid = tuple[int, int, int]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def closed_loop(send: Callable[[int], object], requests: int, clients: int) -> tuple[list[float], float]:
    """``clients`` threads calling ``send(i)`` for ``i`` in ``range(requests)``, each its next
    as soon as its last returns: each call's ms and the loop's wall seconds."""
    lock, next_index, latencies = threading.Lock(), [0], []

    def client():
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= requests:
                return
            start = time.perf_counter()
            send(i)
            with lock:
                latencies.append((time.perf_counter() - start) * 1e3)

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client) for _ in range(clients)]:
            future.result()
    return latencies, time.perf_counter() - start


def call_times_ms(fn: Callable[[], object], device: torch.device, iters: int, warmup: int) -> list[float]:
    """Wall time of each of ``iters`` calls of ``fn`` in ms, after ``warmup`` calls,
    synchronising the device before and after each call."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def median_ms(fn: Callable[[], object], device: torch.device, iters: int, warmup: int) -> float:
    """Median of :func:`call_times_ms`."""
    return statistics.median(call_times_ms(fn, device, iters, warmup))


# Seconds of back-to-back calls before an A/B's rounds: a cool board's clock dips as it reaches
# its power cap, and a block timed in the dip reads slow (benchmarks/HISTORY.md, benchmarks/ab_sequence.py --clocks).
PREHEAT_SECONDS = 5.0


def preheat(fn: Callable[[], object], device: torch.device, seconds: float) -> None:
    """Call ``fn`` back to back for ``seconds`` (then synchronise), so that timing starts on a
    board at the clock it holds under this load (:data:`PREHEAT_SECONDS`)."""
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
    sync(device)


def alternating_ab(run: Callable[[str, torch.Tensor, list], torch.Tensor], keys: tuple[str, ...],
                   cases: dict[str, list], width: int, device: torch.device, rounds: int, iters: int,
                   preheat_s: float = PREHEAT_SECONDS) -> list[tuple]:
    """Same-process A/B of two (or more) ways to ``run(key, pixels, grids)`` an encode. Per case
    (random bf16 pixels on ``device``): each round times each key (median wall ms of ``iters``
    synchronised calls, as :func:`median_ms`), in the same order every round, so that the
    blocks strictly alternate. Returns ``(case, ms of each key..., relative difference of the
    first two keys' outputs)``, medians over rounds. Before each case's rounds, ``preheat_s``
    seconds of calls of the first key bring the board to the clock it holds under load.

    Without the preheat, rounds that start on a cool board put the power cap's first clock dip
    on whichever key it falls in (the mirrored order, ABBA, always on the first key); benchmarks/HISTORY.md
    and ``benchmarks/ab_setting.py``'s doc have the numbers."""
    gen = torch.Generator().manual_seed(0)
    results = []
    for name, grids in cases.items():
        pixels = torch.randn(sum(t * h * w for t, h, w in grids), width, generator=gen).to(device, torch.bfloat16)
        a, b = (run(key, pixels, grids).float() for key in keys[:2])
        for key in keys[2:]:
            run(key, pixels, grids)  # the same first call as the others had
        diff = ((a - b).norm() / a.norm()).item()
        times = {key: [] for key in keys}
        preheat(lambda: run(keys[0], pixels, grids), device, preheat_s)
        for _ in range(rounds):
            for key in keys:
                times[key].append(median_ms(lambda: run(key, pixels, grids), device, iters, 3))
        results.append((name, *(statistics.median(times[key]) for key in keys), diff))
    return results


class CallTimer:
    """Wall seconds and call counts per name, for profiling scripts that wrap library functions."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: defaultdict[str, int] = defaultdict(int)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds
        self.calls[name] += 1

    def wrap(self, name: str, fn: Callable) -> Callable:
        """``fn``, timed under ``name`` (a call that raises counts too)."""
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - start)
        return timed


KERNEL_CLASSES = [("attention", r"flash|fmha|cudnn|attn|sdpa"),
                  ("gemm", r"gemm|nvjet|xmma|cutlass|sm90_|cublas|addmm|\bmm\b|linear"),
                  ("norm", r"layernorm|rmsnorm|layer_norm"), ("rotary", r"rotary"), ("activation", r"activation|silu|gelu"),
                  ("gather", r"index|gather|scatter|take"), ("copy", r"copy|memcpy|memset|cat|fill"), ("other", r".")]


class ClockSampler:
    """``nvidia-smi`` sampling in the background: :meth:`stop` returns (host time, SM MHz, W) rows."""

    def __init__(self, period_ms: int = 20):
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw",
                                      "--format=csv,noheader,nounits", "-lms", str(period_ms)],
                                     stdout=subprocess.PIPE, text=True)

    def stop(self) -> list[tuple[float, float, float]]:
        time.sleep(0.1)
        self.proc.terminate()
        rows = []
        for line in self.proc.stdout.read().strip().splitlines():
            try:
                stamp, clock, power = (x.strip() for x in line.split(","))
                # nvidia-smi writes naive local time, which strptime().timestamp() reads as local
                rows.append((datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp(),
                             float(clock), float(power)))
            except ValueError:
                continue
        return rows


def window_medians(samples: list[tuple[float, float, float]], begin: float, end: float
                   ) -> tuple[float | None, float | None]:
    """Median SM MHz and board W of the :class:`ClockSampler` samples taken from ``begin`` to
    ``end`` (host times); ``None`` for each where no sample falls there."""
    inside = [(mhz, watts) for stamp, mhz, watts in samples if begin <= stamp <= end]
    if not inside:
        return None, None
    return statistics.median(m for m, _ in inside), statistics.median(w for _, w in inside)


def kernel_class(name: str) -> str:
    """A kernel's (or CPU op's) class by its name: attention, gemm, norm, rotary, activation,
    gather, copy, or other."""
    return next(c for c, pattern in KERNEL_CLASSES if re.search(pattern, name, re.I))


def graph_replay_us(fn: Callable[[], object], inner: int = 10, reps: int = 15):
    """Median µs per call of ``fn`` captured ``inner`` times into one CUDA graph (CUDA events
    around each of ``reps`` replays, after a warm-up on a side stream), and the graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    return statistics.median(times), graph


def graph_per_call_us(calls: list[Callable[[], object]]) -> float:
    """Median µs per call of a list of closures (e.g. one per weight set, so weights stream
    from DRAM), all captured into one CUDA graph, one pass per replay."""
    us, _ = graph_replay_us(lambda: [c() for c in calls], inner=1, reps=25)
    return us / len(calls)


def held_replays(graph: torch.cuda.CUDAGraph, seconds: float, window_s: float = 0.5) -> list[tuple[float, float, float, int]]:
    """Replays of ``graph`` back to back for ``seconds`` (the board heats to its power cap), in
    windows of ``window_s``: (host start, host end, GPU ms by CUDA events, replays) per window.
    The host stays within 8 replays of the GPU, so a window's host times bound its GPU work."""
    windows, start = [], time.time()
    while time.time() - start < seconds:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        w_start, replays = time.time(), 0
        begin.record()
        while time.time() - w_start < window_s:
            graph.replay()
            replays += 1
            if replays % 8 == 0:
                torch.cuda.synchronize()
        end.record()
        torch.cuda.synchronize()
        windows.append((w_start, time.time(), begin.elapsed_time(end), replays))
    return windows


def measure_ceilings(device: torch.device) -> dict[str, float]:
    """Dense bf16 GEMM rate (TFLOP/s) and device copy bandwidth (TB/s, bytes read + written)."""
    if device.type != "cuda":
        n, dtype, nbytes = 1024, torch.float32, 64 << 20
    else:
        n, dtype, nbytes = 8192, torch.bfloat16, 2 << 30
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    gemm_ms = median_ms(lambda: a @ b, device, iters=10, warmup=3)
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), device, iters=10, warmup=3)
    return {"gemm_tflops": 2 * n ** 3 / gemm_ms / 1e9, "copy_tbps": 2 * nbytes / copy_ms / 1e9}


def case_flops(tower, grids: list[Grid]) -> float:
    """FLOPs of one forward: every linear layer (and the patch embedding) per row it sees (a
    merger's per output row), attention per segment of each block (a Qwen2.5 window block's
    per window)."""
    tokens = sum(t * h * w for t, h, w in grids)
    flops = 0
    for name, module in tower.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv3d)):
            rows = tokens // tower.merge_unit if "merger" in name else tokens
            flops += 2 * rows * module.weight.numel()
    batch = tower.build_batch(grids)
    width = tower.blocks[0].attn.proj.weight.shape[0]
    full = set(getattr(tower.config, "fullatt_block_indexes", range(len(tower.blocks))))
    for i in range(len(tower.blocks)):
        lengths = (getattr(batch, "frame_lengths", None) if i in full else batch.window_lengths) \
            if hasattr(batch, "window_lengths") else batch.segment_lengths
        flops += sum(4 * n * n * width for n in lengths)
    return flops


def floor_ms(flops: float, weight_bytes: int, ceilings: dict[str, float]) -> float:
    return max(flops / (ceilings["gemm_tflops"] * 1e9), weight_bytes / (ceilings["copy_tbps"] * 1e9))


GPU_SYSTEMS = ("vitgraph_graph", "torch_compile")  # systems that need CUDA


def check_systems(parser, systems, on_gpu: bool) -> None:
    """Refuse, as a usage error, an empty --systems list or GPU-only systems on a CPU."""
    if systems is not None and not systems:
        parser.error("--systems needs at least one system")
    if not on_gpu and systems and set(systems) & set(GPU_SYSTEMS):
        parser.error(f"--systems {' '.join(sorted(set(systems) & set(GPU_SYSTEMS)))} needs a CUDA device")


def build_systems(args, systems: list[str], max_budget: int, **engine_options):
    """The encoders under test, sharing one set of weights: ``(runners, eager_encoder, graph_encoder)``.

    ``runners`` maps a system name to ``run(pixels, grids) -> rows``; the graph encoder is
    None unless ``vitgraph_graph`` is asked for; ``hf_eager`` is skipped without transformers.
    ``engine_options`` (attention, gemm, ...) go to both vitgraph encoders.
    """
    graph_enc = (make_encoder(args, mode="graph", max_budget=max_budget, **engine_options)
                 if "vitgraph_graph" in systems else None)
    base = graph_enc or make_encoder(args, mode="eager", **engine_options)
    eager_enc = GraphedVisionEncoder(base.tower, device=base.device, dtype=base.dtype, mode="eager", **engine_options)
    runners = {"vitgraph_eager": eager_enc.encode}
    if graph_enc is not None:
        runners["vitgraph_graph"] = graph_enc.encode
    if "hf_eager" in systems:
        hf = hf_tower_like(float_twin(args, eager_enc, **engine_options))
        if hf is None:
            print("transformers is not installed: hf_eager skipped", file=sys.stderr)
        else:
            runners["hf_eager"] = hf_call(hf, eager_enc.device)
    return runners, eager_enc, graph_enc


def float_twin(args, encoder: GraphedVisionEncoder, **engine_options) -> GraphedVisionEncoder:
    """``encoder``, or, where ``precision="fp8"`` released its tower's float weights, an eager bf16
    load of the same weights: what transformers' tower, the compiled tower and the fp32 reference read."""
    if encoder.options.precision != "fp8":
        return encoder
    return make_encoder(args, mode="eager", **{**engine_options, "precision": "bf16"})


def hf_tower_like(encoder: GraphedVisionEncoder):
    """transformers' tower of the encoder's family (sdpa) holding the same weights, or None
    without transformers."""
    return transformers_tower(encoder.tower.config, encoder.tower.state_dict(), encoder.tower.inv_freq)


def hf_call(model, device: torch.device):
    def run(pixels: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        with torch.inference_mode():
            out = model(pixels, grid_thw=torch.tensor(grids, device=device))
        deepstack = getattr(out, "deepstack_features", None)
        main = getattr(out, "pooler_output", out)
        return torch.cat([main, *deepstack], dim=1) if deepstack else main
    return run


def eager_peak_bytes(encoder: GraphedVisionEncoder) -> int:
    """Activation peak of one eager forward of each of the largest buckets (packed and dense),
    on the graph bank's own static buffers: what one forward needs without CUDA graphs."""
    bank = encoder.bank
    largest = max(b.tokens for b in bank.buckets)
    return max(bank.activation_peak(b) for b in bank.buckets if b.tokens == largest)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def environment(device: torch.device) -> dict[str, str]:
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"machine": machine, "torch": torch.__version__, "date": datetime.date.today().isoformat()}


def write_json(result: dict, path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1))


def print_table(headers: list[str], rows: list[list[object]]) -> None:
    cells = [[f"{c:.2f}" if isinstance(c, float) else ("-" if c is None else str(c)) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def row_printer(headers: list[str], first_width: int = 12) -> Callable[[list[object]], None]:
    """Print ``headers`` now; returns ``print_row(cells)`` for rows printed as they are measured
    (fixed widths, since the rows to come are not known; flushed, for a log)."""
    widths = [max(len(headers[0]), first_width)] + [max(len(h), 9) for h in headers[1:]]

    def cell(c: object) -> str:
        return f"{c:.2f}" if isinstance(c, float) else ("-" if c is None else str(c))

    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)), flush=True)
    return lambda row: print("  ".join(cell(c).rjust(w) for c, w in zip(row, widths)), flush=True)
