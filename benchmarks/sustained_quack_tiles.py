"""quack tiles (and cuBLAS) for one of the block's GEMMs at 4096 rows, in a burst and held back
to back at the power cap.

    python benchmarks/sustained_quack_tiles.py                 # fc1 + QuickGELU, quack's tiles
    python benchmarks/sustained_quack_tiles.py --layer fc2 --tiles cublas "128x160 pp c21" "128x160 pp c12"

The tile vitgraph runs at 4096 rows was chosen by burst timings (``gemm_quack_epilogue.py``),
where the board is cool. A 4096-token encode runs at the H200's 700 W cap, where the clock
follows energy: a tile that moves fewer bytes per FLOP may hold a higher rate there even if
it is slower in a burst. For each tile (CUDA graphs of 20 calls, weights rotated over 8 sets
so they stream from DRAM as in the tower), after 2 s of rest: the burst µs per call, then
``--seconds`` back to back in half-second windows, with ``nvidia-smi``'s SM clock and board
power; the held rate is the median of the second half's windows. Needs the ``fa4`` extra's
quack and a Hopper GPU.
"""
import argparse
import statistics
import time

import torch

from gemm_quack_epilogue import LAYERS, SETS, register_quick_gelu
from vitgraph.ops import kernels
from vitgraph.bench.common import ClockSampler, graph_per_call_us, held_replays, window_medians

TILES = ["128x160 pp c12", "128x128 pp c12", "256x160 coop c12", "256x128 coop c21", "128x256 coop c12",
         "256x192 coop c12"]


def config(text: str):  # "128x160 pp c12": tile, ping-pong or cooperative, cluster m n
    from quack.gemm_config import GemmConfig

    shape, kind, cluster = text.split()
    tile_m, tile_n = (int(v) for v in shape.split("x"))
    return GemmConfig(tile_m=tile_m, tile_n=tile_n, pingpong=kind == "pp", cluster_m=int(cluster[1]),
                      cluster_n=int(cluster[2]), swap_ab=False, is_dynamic_persistent=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layer", default="fc1", choices=list(LAYERS), help="fc1 runs QuickGELU in its epilogue")
    parser.add_argument("--tiles", nargs="*", default=TILES, help="quack configurations, or cublas (F.linear)")
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    from quack.gemm_interface import gemm_act_tuned, gemm_tuned

    register_quick_gelu()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    k, n = LAYERS[args.layer]
    act = args.layer == "fc1"
    m = args.rows
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(SETS)]
    bs = [torch.randn(n, device=dev, dtype=torch.bfloat16) for _ in range(SETS)]
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    flops = 2 * m * k * n
    sampler = ClockSampler()
    results = []
    for text in args.tiles:
        cfg = None if text == "cublas" else config(text)

        def call(i, cfg=cfg):
            w, b = ws[i % SETS], bs[i % SETS]
            if cfg is None:  # what the tower runs for proj and fc2 (fc1: + vitgraph's QuickGELU pass)
                y = torch.nn.functional.linear(x, w, b)
                if act:
                    kernels.quick_gelu_(y)
            elif act:
                gemm_act_tuned.fn(x, w.t(), None, out, None, b, "quick_gelu", config=cfg)
            else:
                gemm_tuned.fn(x, w.t(), out, bias=b, config=cfg)
        try:
            call(0)
            torch.cuda.synchronize()
        except Exception as exc:  # a configuration quack cannot build
            print(f"{text}: failed ({type(exc).__name__}: {str(exc)[:100]})", flush=True)
            continue
        burst = graph_per_call_us([lambda i=i: call(i) for i in range(SETS)])
        calls = 20
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                call(i)
        torch.cuda.synchronize()
        time.sleep(2.0)  # start from a rested board
        windows = [(a, b, ms * 1e3 / (replays * calls)) for a, b, ms, replays in held_replays(graph, args.seconds)]
        results.append((text, burst, windows))
        print(f"{text}: burst {burst:.1f} us", flush=True)
    samples = sampler.stop()
    print(f"\n{args.layer}{' + QuickGELU' if act else ''}, {m} x {k} @ {k} x {n}, {args.seconds:.0f} s back to back per tile")
    print(f"{'tile':20s} {'burst us':>9s} {'held us':>8s} {'held TFLOP/s':>13s} {'SM MHz':>7s} {'W':>5s}")
    for text, burst, windows in results:
        late = windows[len(windows) // 2:]
        us = statistics.median(w[2] for w in late)
        mhz, watts = window_medians(samples, late[0][0], late[-1][1])
        print(f"{text:20s} {burst:9.1f} {us:8.1f} {flops / us / 1e6:13.0f} "
              f"{mhz if mhz is not None else float('nan'):7.0f} {watts if watts is not None else float('nan'):5.0f}")


if __name__ == "__main__":
    main()
