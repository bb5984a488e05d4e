"""A/B of module-level settings of vitgraph, end to end, in one process.

    python benchmarks/ab_setting.py vitgraph.gemm.QUACK_QKV_MIN_ROWS=10**9   # qkv back on cuBLAS
    python benchmarks/ab_setting.py vitgraph.gemm.QUACK_MIN_ROWS=256 --cases 1x256 --rounds 7
    python benchmarks/ab_setting.py vitgraph.attention.FA4_SHORT_SEQLEN=0 --cases --frames 40x40 44x46   # single frames

Two graph encoders of the 2B model with the same random weights: ``default`` and
``changed``, the second built (captured) and called with the settings changed. Each round
times every case on both (median wall ms of ``--iters`` synchronised ``encode`` calls, as
``benchmarks/latency.py``), alternating which goes first; the table shows the median over
rounds and the relative difference of the two outputs.

The encoder built second can be faster whatever its settings (0.22 ms at ``4x1024`` in two
A/Bs of opposite settings on one H200, BENCHMARKS.md): where a difference is that small,
repeat with ``--changed-first`` and trust only what holds in both build orders.
"""

import argparse
import ast
import importlib

import torch

from vitgraph import GraphedVisionEncoder
from vitgraph.bench.common import alternating_ab, print_table
from vitgraph.bench.latency import CASES


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("settings", nargs="+", help="module.NAME=value (an int, float or string literal, or 10**N)")
    p.add_argument("--cases", nargs="*", default=list(CASES))
    p.add_argument("--frames", nargs="*", default=[], help="more cases: one frame of HxW patches each")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--changed-first", action="store_true", help="build the changed encoder first")
    args = p.parse_args()
    settings = []  # (module, name, default, changed)
    for text in args.settings:
        target, value = text.split("=", 1)
        module_name, attr = target.rsplit(".", 1)
        module = importlib.import_module(module_name)
        base, _, power = value.partition("**")
        changed = ast.literal_eval(base) ** int(power) if power else ast.literal_eval(value)
        settings.append((module, attr, getattr(module, attr), changed))
        print(f"{target}: default {getattr(module, attr)!r}, changed {changed!r}")

    def apply(key):
        for module, attr, default, changed in settings:
            setattr(module, attr, default if key == "default" else changed)

    device = torch.device("cuda")
    encoders = {}
    order = ("changed", "default") if args.changed_first else ("default", "changed")
    print("build order:", ", ".join(order))
    for key in order:
        apply(key)
        encoders[key] = GraphedVisionEncoder.from_config("qwen2-vl-2b", device=device, seed=0, progress=False)
    # Steps are routed by timings taken at capture: one routing for both, unless the settings
    # change which buckets exist or how routing is timed (then each keeps the routing it measured).
    routing_changed = any(module.__name__ == "vitgraph.capture.routing" for module, *_ in settings)
    if encoders["changed"].buckets == encoders["default"].buckets and not routing_changed:
        encoders["changed"]._packed_single_below = dict(encoders["default"]._packed_single_below)
        encoders["changed"]._faster_next = dict(encoders["default"]._faster_next)
    else:
        print("each encoder keeps its own routing; single-frame thresholds:",
              {key: enc._packed_single_below for key, enc in encoders.items()})
    for key, enc in encoders.items():
        print(f"{key}: faster next buckets {enc.stats()['faster_next_bucket']}, routing timed in "
              f"{enc._routing_seconds:.2f} s")
    cfg = encoders["default"].config

    def encode(key, pixels, grids):
        apply(key)  # eager calls (1x9604) read settings at call time
        return encoders[key].encode(pixels, grids)

    cases = {name: CASES[name] for name in args.cases}
    for frame in args.frames:
        h, w = (int(x) for x in frame.split("x"))
        cases[f"1 frame {h}x{w}"] = [(1, h, w)]
    results = alternating_ab(encode, ("default", "changed"), cases, cfg.patch_width, device, args.rounds, args.iters)
    rows = [[name, default, changed, changed - default, f"{diff:.1e}"] for name, default, changed, diff in results]
    print_table(["case", "default ms", "changed ms", "delta ms", "rel diff"], rows)


if __name__ == "__main__":
    main()
