"""A/B of tuning settings of vitgraph (:mod:`vitgraph.runtime.tuning`), end to end, in one process.

    python benchmarks/ab_setting.py gemm.qkv_min_rows=10**9   # qkv back on cuBLAS
    python benchmarks/ab_setting.py gemm.fc1_min_rows=256 --cases 1x256 --rounds 7
    python benchmarks/ab_setting.py attention.short_seqlen=0 --cases --frames 40x40 44x46   # single frames
    python benchmarks/ab_setting.py gemm.split_k=4 --both-orders   # both build orders in one run
    python benchmarks/ab_setting.py gemm.split_k=4 --both-orders --control   # and an A/A beside it

Two graph encoders of the 2B model with the same random weights: ``default`` and
``changed``, the second built with the settings changed (``EngineOptions(tuning=...)``). Each round
times every case on both (median wall ms of ``--iters`` synchronised ``encode`` calls, as
``benchmarks/latency.py``), the two strictly alternating; the table shows the median over
rounds and the relative difference of the two outputs.

Each case's rounds follow ``--preheat`` seconds (default 5) of calls, so that every block
runs on a board that holds its loaded clock: from a cool start the block timed about 1 s in,
as the board first reaches its power cap, read 0.3-0.9 ms slow at ``4x1024`` on an H200
whichever encoder it was (``ab_sequence.py --clocks``). Before that preheat, and before strict
alternation replaced a mirrored order (ABBA), A/As at 4096 tokens read up to 0.29 ms: older
deltas of that size are not evidence. With it, A/As read within 0.05 ms at ``4x1024``,
``16x256`` and the clip and 0.12 at ``1x4096`` (``h200-ab-layernorm-wide-preheat.log``). Still
run an A/A beside an A/B (``--control``) and check both build orders (``--both-orders`` runs
both, each with new encoders, and prints the two deltas side by side; ``--changed-first``
runs the second alone).
"""

import argparse
import ast
import gc

import torch

from vitgraph import GraphedVisionEncoder
from vitgraph.bench.common import PREHEAT_SECONDS, alternating_ab, print_table
from vitgraph.bench.latency import CASES, select_cases
from vitgraph.models import PRESETS, tower_dims
from vitgraph.runtime.tuning import derive_tuning


def parse_settings(texts: list[str], preset: str, device: torch.device) -> dict:
    """``group.field=value`` texts -> the tuning changes ``{name: value}``."""
    settings = {}
    for text in texts:
        name, value = text.split("=", 1)
        base, _, power = value.partition("**")
        settings[name] = ast.literal_eval(base) ** int(power) if power else ast.literal_eval(value)
    derived = derive_tuning(tower_dims(PRESETS[preset]), device)
    changed = derive_tuning(tower_dims(PRESETS[preset]), device, settings)  # refuses unknown names
    for name in settings:
        group, field = name.split(".")
        print(f"{name}: default {getattr(getattr(derived, group), field)!r}, "
              f"changed {getattr(getattr(changed, group), field)!r}")
    return settings


def run_order(args, settings, order: tuple[str, ...], cases: dict, device: torch.device) -> list[tuple]:
    """Build the encoders in ``order`` and time ``cases`` on each: :func:`alternating_ab`'s rows
    (keys default, changed, then control where ``order`` has it: a second encoder with the
    default settings)."""
    encoders = {}
    print("build order:", ", ".join(order))
    for key in order:
        encoders[key] = GraphedVisionEncoder.from_config(args.preset, device=device, seed=0, progress=False,
                                                         tuning=settings if key == "changed" else None)
    # Steps are routed by timings taken at capture: one routing for both, unless the settings
    # change which buckets exist or how routing is timed (then each keeps the routing it measured).
    routing_changed = any(name.startswith("routing.") for name in settings)
    if encoders["changed"].buckets == encoders["default"].buckets and not routing_changed:
        for key in set(encoders) - {"default"}:
            encoders[key]._packed_single_below = dict(encoders["default"]._packed_single_below)
            encoders[key]._faster_next = dict(encoders["default"]._faster_next)
    else:
        print("each encoder keeps its own routing; single-frame thresholds:",
              {key: enc._packed_single_below for key, enc in encoders.items()})
    for key, enc in encoders.items():
        print(f"{key}: faster next buckets {enc.stats()['faster_next_bucket']}, routing timed in "
              f"{enc._routing_seconds:.2f} s")

    def encode(key, pixels, grids):
        return encoders[key].encode(pixels, grids)

    try:
        keys = ("default", "changed", "control") if "control" in encoders else ("default", "changed")
        return alternating_ab(encode, keys, cases, encoders["default"].shape.patch_width, device,
                              args.rounds, args.iters, args.preheat)
    finally:
        encoders.clear()  # free the graphs and their pool before the next order builds its own
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("settings", nargs="+", help="group.field=value of vitgraph.runtime.tuning (a Python literal, or 10**N)")
    p.add_argument("--cases", nargs="*", default=list(CASES))
    p.add_argument("--frames", nargs="*", default=[], help="more cases: one frame of HxW patches each")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    order = p.add_mutually_exclusive_group()
    order.add_argument("--changed-first", action="store_true", help="build the changed encoder first")
    order.add_argument("--both-orders", action="store_true",
                       help="run the A/B twice, each build order with new encoders, and show both deltas")
    p.add_argument("--control", action="store_true",
                   help="also build a second default encoder (last) and time it in turn: its delta from the "
                        "first is an A/A, the noise the A/B's delta must beat")
    p.add_argument("--preheat", type=float, default=PREHEAT_SECONDS,
                   help="seconds of calls before each case's rounds, so that the board holds its loaded clock")
    p.add_argument("--preset", default="qwen2-vl-2b", help="the model shape (a vitgraph preset; random weights)")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    device = torch.device(args.device)
    settings = parse_settings(args.settings, args.preset, device)
    cases = select_cases(args.cases, args.frames)
    if args.both_orders:
        orders = [("default", "changed"), ("changed", "default")]
    else:
        orders = [("changed", "default") if args.changed_first else ("default", "changed")]
    if args.control:
        orders = [order + ("control",) for order in orders]
    runs = [run_order(args, settings, order, cases, device) for order in orders]
    for order, results in zip(orders, runs):
        print(f"{order[0]} built first:")
        if args.control:
            rows = [[name, default, changed, control, changed - default, control - default, f"{diff:.1e}"]
                    for name, default, changed, control, diff in results]
            print_table(["case", "default ms", "changed ms", "control ms", "delta ms", "A/A ms", "rel diff"], rows)
        else:
            rows = [[name, default, changed, changed - default, f"{diff:.1e}"] for name, default, changed, diff in results]
            print_table(["case", "default ms", "changed ms", "delta ms", "rel diff"], rows)
    if len(runs) == 2:
        # What to trust: a delta of one sign in both orders, and larger than the A/A's.
        print("both orders (delta ms = changed - default):")
        rows = []
        for first, second in zip(*runs):
            deltas = (first[2] - first[1], second[2] - second[1])
            same = deltas[0] * deltas[1] > 0
            row = [first[0], *deltas, (deltas[0] + deltas[1]) / 2, "yes" if same else "no"]
            if args.control:
                row.append(max(abs(first[3] - first[1]), abs(second[3] - second[1])))
            rows.append(row)
        print_table(["case", "default first", "changed first", "mean", "same sign"]
                    + (["largest |A/A|"] if args.control else []), rows)


if __name__ == "__main__":
    main()
