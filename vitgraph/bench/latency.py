"""Latency of one ``encode`` call: vitgraph against transformers' eager tower and torch.compile.

    vitgraph bench                                     # qwen2-vl-2b random weights on GPU, tiny on CPU
    vitgraph bench --model Qwen/Qwen2-VL-2B-Instruct
    vitgraph bench --preset tiny --device cpu --iters 5
    vitgraph bench --case mine=1,32,48+2,16,16         (or: python benchmarks/latency.py ...)
    vitgraph bench --preheat 3                         # each system timed after 3 s of its own load

Every system's output is checked before it is timed against an fp32 eager run of the same
weights (in fp32: against ``vitgraph_eager``): no farther from it than transformers' own
bf16/fp16 tower is, by half again, and never beyond the dtype's tolerance unless that is. The
timed region is the whole call as a user makes it (planning, metadata, copies).
Prints a table of median milliseconds per call; ``--json`` and ``--plot`` write files.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import time
from pathlib import Path

import torch

from .. import cli_args
from ..ops.fp8 import held_bytes
from . import common
from .args import CASES, CPU_CASES, ITERS, WARMUP
from .args import LATENCY_SYSTEMS as SYSTEMS, latency_parser as build_parser

CHECK_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}
# precision="fp8": its rounding floor reaches 7.4e-2 (Qwen2-VL-2B) to 0.12 (Qwen2.5-VL-7B, issue 78's study).
FP8_TOLERANCE = 0.15


def select_cases(names: list[str], frames: list[str] = ()) -> dict[str, list[tuple[int, int, int]]]:
    """``CASES`` by name, then one case per ``HxW`` text: one frame of that many patches."""
    cases = {name: CASES[name] for name in names}
    for frame in frames:
        h, w = (int(v) for v in frame.split("x"))
        cases[f"1 frame {h}x{w}"] = [(1, h, w)]
    return cases


def compiled_system(encoder):
    """torch.compile(mode="reduce-overhead") of the plain tower (``forward_reference``: what a user
    would compile), one compile per exact shape, attending through torch's own kernels (FA2
    varlen, cuDNN SDPA for one frame): an optional kernel library vitgraph may use (FlashAttention
    4's CuTe DSL) is no part of what a user compiles, and would break dynamo's graphs."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    device = encoder.device
    # A twin of the tower that shares its weights, so that the encoders keep their backend.
    shared = {id(t): t for t in (*encoder.tower.parameters(), *encoder.tower.buffers())}
    tower = copy.deepcopy(encoder.tower, shared)
    tower.set_attention_backend("varlen" if device.type == "cuda" else "sdpa")
    # The plain forward (Qwen2-VL keeps it beside its fused one); the batch's tensors are the
    # compiled function's inputs, its other fields constants of each exact shape.
    forward = getattr(tower, "forward_reference", tower.forward)
    compiled = {}
    compile_seconds = {}

    def run(pixels, grids):
        key = tuple(grids)
        batch = tower.build_batch(grids).to(device, non_blocking=True)
        names = list(batch.tensors())
        if key not in compiled:
            template = batch

            def call(px, *tensors):
                return forward(px, dataclasses.replace(template, **dict(zip(names, tensors))))

            compiled[key] = torch.compile(call, mode="reduce-overhead", dynamic=False)
            start = time.perf_counter()
            for _ in range(3):  # compile, then the warm-ups cudagraph trees need before recording
                compiled[key](pixels, *batch.tensors().values())
            common.sync(device)
            compile_seconds[key] = time.perf_counter() - start
        return compiled[key](pixels, *batch.tensors().values()).clone()

    return run, compile_seconds


def fp32_reference(encoder):
    """An fp32 eager run of ``encoder``'s weights (plain forward, torch's attention), or None
    where the encoder is fp32 already."""
    if encoder.dtype == torch.float32:
        return None
    from ..runtime.encoder import GraphedVisionEncoder

    tower = copy.deepcopy(encoder.tower).float()
    truth = GraphedVisionEncoder(tower, device=encoder.device, dtype=torch.float32, mode="eager", fuse=False,
                                 attention="sdpa", progress=False)
    return lambda pixels, grids: truth.encode(pixels.float(), grids)


def plot(result: dict, path: str, systems: list[str]) -> None:
    """Grouped bars per case (log scale), the hardware floor as a black tick on each group."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install vitgraph[bench])", file=sys.stderr)
        return
    cases = result["cases"]
    width = 0.8 / max(1, len(systems))
    fig, ax = plt.subplots(figsize=(10, 5))
    for i, system in enumerate(systems):
        xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(cases))]
        ax.bar(xs, [c["ms"].get(system) or 0 for c in cases], width, label=system)
    for j, c in enumerate(cases):
        ax.hlines(c["floor_ms"], j - 0.45, j + 0.45, colors="black", linewidth=2,
                  label="hardware floor" if j == 0 else None)
    ax.set_xticks(range(len(cases)), [f"{c['case']}\n{c['tokens']} tokens" for c in cases], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("median latency per encode call (ms)")
    ax.set_title(f"{result['preset']} ({result['dtype']}) on {result['machine']}, torch {result['torch']}, "
                 f"{result['date']}")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    on_gpu = cli_args.resolve_model_args(args)
    common.check_systems(parser, args.systems, on_gpu)
    if args.preheat < 0:
        parser.error(f"--preheat must be >= 0, got {args.preheat}")
    where = "gpu" if on_gpu else "cpu"
    args.iters = args.iters or ITERS[where]
    args.warmup = WARMUP[where] if args.warmup is None else args.warmup
    cases = {name: CASES[name] for name in (args.cases if args.cases is not None else CASES if on_gpu else CPU_CASES)}
    cases.update(dict(args.case))
    systems = args.systems or [s for s in SYSTEMS if on_gpu or s in ("hf_eager", "vitgraph_eager")]
    if not on_gpu:
        _say_what_a_cpu_run_leaves_out(args, cases)

    runners, eager_enc, graph_enc = common.build_systems(args, systems, args.max_budget, attention=args.attention,
                                                         gemm=args.gemm, precision=args.precision)
    # Capture of every bucket, including the first-call JIT of vitgraph's Triton kernels.
    capture_s = graph_enc.stats()["capture_seconds"] if graph_enc else None
    device, dtype, cfg = eager_enc.device, eager_enc.dtype, eager_enc.shape
    weight_bytes = held_bytes(eager_enc.tower)  # FP8: the e4m3 copies, not the released float weights
    ceilings = common.measure_ceilings(device)
    compile_seconds = {}
    twin = common.float_twin(args, eager_enc, attention=args.attention, gemm=args.gemm)
    if "torch_compile" in systems:
        runners["torch_compile"], compile_seconds = compiled_system(twin)

    result = {**common.environment(device), "preset": args.model or args.preset, "dtype": str(dtype)[6:],
              "attention": eager_enc.attention, "gemm": eager_enc.gemm, "precision": args.precision,
              "ceilings": ceilings, "weight_bytes": weight_bytes, "capture_s": capture_s, "preheat_s": args.preheat,
              "buckets": [b.name for b in graph_enc.buckets] if graph_enc else [],
              "pool_bytes": graph_enc.stats()["pool_bytes"] if graph_enc else None,
              "pool_workspace_bytes": graph_enc.stats()["pool_workspace_bytes"] if graph_enc else None,
              "eager_peak_bytes": common.eager_peak_bytes(graph_enc) if graph_enc else None, "cases": []}
    if graph_enc is not None:
        print(f"captured {len(graph_enc.buckets)} buckets in {capture_s:.1f} s, pool {result['pool_bytes'] / 2**20:.0f} MiB"
              f" ({result['pool_workspace_bytes'] / 2**20:.0f} MiB workspaces), eager peak "
              f"{result['eager_peak_bytes'] / 2**20:.0f} MiB", file=sys.stderr)
    truth, bound = fp32_reference(twin) or twin.encode, FP8_TOLERANCE if args.precision == "fp8" else CHECK_TOLERANCE[dtype]
    gen = torch.Generator(device="cpu").manual_seed(0)
    shown = [s for s in systems if s in runners]
    print_row = _print_heading(result, shown, bool(compile_seconds), device.type == "cuda")
    for name, grids in cases.items():
        tokens = sum(t * h * w for t, h, w in grids)
        pixels = torch.randn(tokens, cfg.patch_width, generator=gen).to(device, dtype)
        entry = {"case": name, "grid": [list(g) for g in grids], "tokens": tokens,
                 "floor_ms": common.floor_ms(common.case_flops(eager_enc.tower, grids), weight_bytes, ceilings),
                 "check": _checked(name, runners, systems, pixels, grids, truth(pixels, grids).float(), bound),
                 "ms": {}, "compile_s": compile_seconds.get(tuple(grids))}
        for system in (s for s in systems if s in runners):
            run = runners[system]
            common.preheat(lambda: run(pixels, grids), device, args.preheat)
            entry["ms"][system] = common.median_ms(lambda: run(pixels, grids), device, args.iters, args.warmup)
        result["cases"].append(entry)
        print_row(entry)  # each row as it is measured: a slow machine shows its progress
    common.write_json(result, args.json)
    if args.plot:
        plot(result, args.plot, shown)
    return result


def _checked(name: str, runners: dict, systems: list[str], pixels, grids, reference, bound: float) -> dict[str, float]:
    """Each system's relative error from the fp32 reference; a system farther from it than
    transformers' own (by half again), or than ``bound`` (the dtype's, or FP8's), stops the run."""
    check = {s: common.rel_err(runners[s](pixels, grids).float(), reference) for s in systems if s in runners}
    tolerance = max(bound, 1.5 * check.get("hf_eager", 0.0))
    for system, err in check.items():
        if not err <= tolerance:
            raise SystemExit(f"{system} on {name}: rel err {err:.3e} from the fp32 reference, above {tolerance:.3e}"
                             f" ({', '.join(f'{s} {e:.2e}' for s, e in check.items())})")
    return check


def _say_what_a_cpu_run_leaves_out(args, cases: dict) -> None:
    left = [name for name in CASES if name not in cases]
    print(f"vitgraph bench on a CPU: no CUDA graphs (vitgraph_graph) and no torch.compile (torch_compile), both "
          f"need a GPU; {len(cases)} case(s), {args.iters} timed call(s) each"
          + (f"; cases left out: {' '.join(left)} (--cases names them)" if left else ""), file=sys.stderr)


def _print_heading(result: dict, shown: list[str], compiled: bool, on_gpu: bool):
    """Print what the table measures and its header; returns ``print_row(case entry)``."""
    ceilings = result["ceilings"]
    gemm = f", gemm {result['gemm']}" if on_gpu else ""  # the GEMM backend is a GPU choice
    print(f"{result['preset']} {result['dtype']} on {result['machine']}, torch {result['torch']}, "
          f"{result['date']}; attention {result['attention']}{gemm}; "
          f"measured GEMM {ceilings['gemm_tflops']:.3g} TFLOP/s, copy {ceilings['copy_tbps']:.3g} TB/s")
    if result["buckets"]:
        print(f"captured {len(result['buckets'])} buckets in {result['capture_s']:.1f} s, pool "
              f"{result['pool_bytes'] / 2**20:.0f} MiB ({result['pool_workspace_bytes'] / 2**20:.0f} MiB of it cuBLAS "
              f"workspaces) (eager activation peak of the largest bucket {result['eager_peak_bytes'] / 2**20:.0f} MiB)")
    print("median ms per call; floor: the least time the case can take here, max(its FLOPs at the "
          "measured GEMM rate, its weight bytes at the measured copy rate)")
    headers = ["case", "tokens", "floor ms"] + [f"{s} ms" for s in shown] + (["compile s"] if compiled else [])
    print_row = common.row_printer(headers, first_width=max(len(name) for name in CASES) + 4)
    return lambda c: print_row([c["case"], c["tokens"], c["floor_ms"]] + [c["ms"].get(s) for s in shown]
                               + ([c["compile_s"]] if compiled else []))


if __name__ == "__main__":
    main()
