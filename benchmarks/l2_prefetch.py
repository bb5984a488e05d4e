"""Would warming L2 with the next GEMM's weights, from a side stream inside the graph, speed up
the block's GEMMs at few tokens?

At 256-1024 tokens the tower's GEMMs leave SMs idle and run far below copy bandwidth, yet a
GEMM whose weights sit in L2 runs ~25% faster than one streaming them from DRAM. This times
8 blocks of real-size weights (qkv, proj, fc1, fc2; 8 x 39 MB, so nothing stays in the 50 MB
L2) captured in one CUDA graph, with and without a small kernel on a forked stream that pulls
a later GEMM's weights into L2 while the current GEMM runs.

Prefetch kernels: ``load`` reads the weights (evict-last) and keeps a per-program sum;
``hint`` issues PTX ``prefetch.global.L2::evict_last`` per 128-byte line (nothing waits).
``--copies``: instead of kernels (which take SMs from the GEMMs), device-to-device copies
(``cudaMemcpyAsync``, memcpy nodes in the graph, run by the copy engines) of the later GEMM's
weights, whole into a scratch as large (``copy``) or in chunks of ``p`` MiB into one scratch
chunk (``chunks``), so that the written bytes hold little of L2. ``resident``: every block
runs the first block's weights, which stay in L2 (the bound a prefetch could reach).
Usage: l2_prefetch.py [M ...] [--copies]
"""
import itertools
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vitgraph.bench.common import graph_replay_us

LAYERS = {"qkv": (1280, 3840), "proj": (1280, 1280), "fc1": (1280, 5120), "fc2": (5120, 1280)}
BLOCKS = 8


@triton.jit
def _load_kernel(w_ptr, sink_ptr, numel, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK, numel, step):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + offs, mask=offs < numel, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(sink_ptr + pid, tl.sum(acc))


@triton.jit
def _hint_kernel(w_ptr, sink_ptr, lines, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid * BLOCK, lines, step):
        line = start + tl.arange(0, BLOCK)
        ptrs = w_ptr + tl.minimum(line, lines - 1).to(tl.int64) * 64  # 64 bf16 = one 128-byte line
        acc += tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                         dtype=tl.int32, is_pure=False, pack=1)
    tl.store(sink_ptr + pid, tl.sum(acc))


def prefetch(kind: str, w: torch.Tensor, sink: torch.Tensor, programs: int) -> None:
    if kind == "copy":
        sink[:w.numel()].copy_(w.view(-1))
    elif kind == "chunks":
        flat, chunk = w.view(-1), programs << 19  # p MiB of bf16
        for start in range(0, flat.numel(), chunk):
            part = flat[start:start + chunk]
            sink[:part.numel()].copy_(part)
    elif kind == "load":
        _load_kernel[(programs,)](w, sink, w.numel(), BLOCK=4096, num_warps=8)
    else:
        _hint_kernel[(programs,)](w, sink, triton.cdiv(w.numel(), 64), BLOCK=1024, num_warps=4)


def replay_us(forward) -> float:
    """Median µs per block of one graph replay of ``forward``."""
    return graph_replay_us(forward, inner=1, reps=30)[0] / BLOCKS


def main(ms: list[int], copies: bool) -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    weights = [(name, torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02,
                torch.randn(n, device=dev, dtype=torch.bfloat16))
               for _ in range(BLOCKS) for name, (k, n) in LAYERS.items()]
    resident = weights[:len(LAYERS)] * BLOCKS
    # the copies' destination: as large as the largest weight (bf16); the kernels' per-program sums
    sink = torch.zeros(max(w.numel() for _, w, _ in weights), device=dev, dtype=torch.bfloat16) if copies else \
        torch.zeros(1024, device=dev)
    print(f"{torch.cuda.get_device_name()}, {BLOCKS} blocks, µs per block (4 GEMMs)")
    for m in ms:
        inputs = {k: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for k in (1280, 5120)}

        def forward(kind=None, distance=1, programs=16, weights=weights):
            main_stream = torch.cuda.current_stream()
            helper = torch.cuda.Stream() if kind else None
            for j, (_, w, b) in enumerate(weights):
                if kind and j + distance < len(weights):
                    helper.wait_stream(main_stream)
                    with torch.cuda.stream(helper):
                        prefetch(kind, weights[j + distance][1], sink, programs)
                F.linear(inputs[w.shape[1]], w, b)
            if kind:
                main_stream.wait_stream(helper)

        base = replay_us(forward)
        results = []
        if copies:
            print(f"M={m:5d} weights resident in L2 {replay_us(lambda: forward(weights=resident)):6.1f}", flush=True)
            variants = [("copy", d, 0) for d in (1, 2)] + list(itertools.product(("chunks",), (1, 2), (1, 2, 4)))
        else:
            variants = itertools.product(("load", "hint"), (1, 2), (8, 16, 32, 64))
        for kind, distance, programs in variants:
            results.append((replay_us(lambda: forward(kind, distance, programs)), kind, distance, programs))
        results.sort()
        best = ", ".join(f"{us:.1f} ({kind} d={d} p={p})" for us, kind, d, p in (results if copies else results[:4]))
        worst = results[-1]
        print(f"M={m:5d} no prefetch {base:6.1f} | best: {best} | worst {worst[0]:.1f} ({worst[1]} d={worst[2]} p={worst[3]})",
              flush=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--copies"]
    main([int(a) for a in args] or [256, 512, 1024, 2048], "--copies" in sys.argv[1:])
