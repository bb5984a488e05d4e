"""Does cuBLAS have faster algorithms for the tower's GEMMs than the one torch's heuristic picks?

For each of a block's four linear layers (qkv, proj, fc1, fc2) at a few token counts, times
inside CUDA graphs, with 8 weight sets rotated so that weights stream from DRAM as they do in
the 32-block tower (one set would sit in the 50 MB L2):

- ``torch``: ``F.linear`` (what the tower runs; weight [N, K], "TN");
- ``torch NN``: ``torch.addmm`` with the weight stored transposed ([K, N]);
- ``torch cublas``: ``F.linear`` with ``preferred_blas_library("cublas")``;
- ``lt#i``: each of the first ``--algos`` cuBLASLt algorithms that ``nvmath-python`` lists for the
  problem (bias epilogue), in cuBLASLt's heuristic order; ``lt#0`` is its first choice.

Usage: gemm_cublaslt_algos.py [M ...] [--algos N]. Needs nvmath-python (and cuda-core).
"""
import argparse

import torch
import torch.nn.functional as F

from vitgraph.bench.common import graph_per_call_us as per_call_us

LAYERS = {"qkv": (1280, 3840), "proj": (1280, 1280), "fc1": (1280, 5120), "fc2": (5120, 1280)}
SETS = 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ms", nargs="*", type=int, default=[256, 1024, 4096])
    parser.add_argument("--algos", type=int, default=12)
    args = parser.parse_args()

    from nvmath.linalg.advanced import Matmul, MatmulEpilog, MatmulPlanPreferences

    torch.manual_seed(0)
    dev = torch.device("cuda")
    default_lib = torch.backends.cuda.preferred_blas_library()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} default blas {default_lib}")
    totals: dict[int, dict[str, float]] = {}
    for m in args.ms:
        totals[m] = {"torch": 0.0, "best": 0.0}
        for name, (k, n) in LAYERS.items():
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(SETS)]
            bs = [torch.randn(n, device=dev, dtype=torch.bfloat16) for _ in range(SETS)]
            wts = [w.t().contiguous() for w in ws]
            ref = F.linear(x, ws[0], bs[0]).float()

            row = {}
            row["torch"] = per_call_us([lambda w=w, b=b: F.linear(x, w, b) for w, b in zip(ws, bs)])
            row["torch NN"] = per_call_us([lambda w=w, b=b: torch.addmm(b, x, w) for w, b in zip(wts, bs)])
            torch.backends.cuda.preferred_blas_library("cublas")
            row["torch cublas"] = per_call_us([lambda w=w, b=b: F.linear(x, w, b) for w, b in zip(ws, bs)])
            torch.backends.cuda.preferred_blas_library(default_lib)

            mms = []
            for w, b in zip(ws, bs):
                # cuBLASLt's bias runs along the result's rows: plan y.T = W @ x.T, as torch does
                mm = Matmul(w, x.t())
                mm.plan(preferences=MatmulPlanPreferences(limit=args.algos), epilog=MatmulEpilog.BIAS,
                        epilog_inputs={"bias": b})
                mms.append(mm)
            lt_times = []
            for i, algo in enumerate(mms[0].algorithms):
                got = mms[0].execute(algorithm=algo).t()
                err = ((got.float() - ref).norm() / ref.norm()).item()
                if i == 0 and name == "qkv":
                    print(f"  M={m} result of y.T = W @ x.T has strides {got.stride()} (y row-major: {got.is_contiguous()})")
                try:
                    us = per_call_us([lambda mm=mm, i=i: mm.execute(algorithm=mm.algorithms[i]) for mm in mms])
                except Exception as exc:  # an algorithm that cannot be captured is reported, not fatal
                    print(f"  M={m} {name} lt#{i}: not timed ({type(exc).__name__}: {exc})")
                    continue
                lt_times.append((us, i, algo.tile, algo.split_k, err))
            lt_times.sort()
            # No mm.free(): its last event was recorded under capture and cannot be waited on.
            best = min([row["torch"], row["torch NN"], row["torch cublas"]] + [t[0] for t in lt_times])
            totals[m]["torch"] += row["torch"]
            totals[m]["best"] += best
            lt0 = next((t[0] for t in lt_times if t[1] == 0), float("nan"))
            shown = "; ".join(f"lt#{i} {us:.1f} tile={tile} splitk={sk} err={err:.1e}"
                              for us, i, tile, sk, err in lt_times[:3])
            print(f"M={m:5d} {name:4s} torch {row['torch']:6.1f} | NN {row['torch NN']:6.1f} | "
                  f"cublas {row['torch cublas']:6.1f} | lt#0 {lt0:6.1f} | best lt: {shown}", flush=True)
    print("\nper block (qkv+proj+fc1+fc2), µs: M, torch, best of all variants per layer")
    for m, t in totals.items():
        print(f"  M={m:5d} {t['torch']:8.1f} {t['best']:8.1f}  ({(t['best'] / t['torch'] - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
