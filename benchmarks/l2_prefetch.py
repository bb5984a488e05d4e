"""Would warming L2 with the next GEMM's weights, from a side stream inside the graph, speed up
the block's GEMMs at few tokens?

At 256-1024 tokens the tower's GEMMs leave SMs idle and run far below copy bandwidth, yet a
GEMM whose weights sit in L2 runs ~25% faster than one streaming them from DRAM. This times
8 blocks of real-size weights (qkv, proj, fc1, fc2; 8 x 39 MB, so nothing stays in the 50 MB
L2) captured in one CUDA graph, with and without a small kernel on a forked stream that pulls
a later GEMM's weights into L2 while the current GEMM runs.

Prefetch kernels: ``load`` reads the weights (evict-last) and keeps a per-program sum;
``hint`` issues PTX ``prefetch.global.L2::evict_last`` per 128-byte line (nothing waits).
Usage: l2_prefetch.py [M ...]
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
    if kind == "load":
        _load_kernel[(programs,)](w, sink, w.numel(), BLOCK=4096, num_warps=8)
    else:
        _hint_kernel[(programs,)](w, sink, triton.cdiv(w.numel(), 64), BLOCK=1024, num_warps=4)


def replay_us(forward) -> float:
    """Median µs per block of one graph replay of ``forward``."""
    return graph_replay_us(forward, inner=1, reps=30)[0] / BLOCKS


def main(ms: list[int]) -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    weights = [(name, torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02,
                torch.randn(n, device=dev, dtype=torch.bfloat16))
               for _ in range(BLOCKS) for name, (k, n) in LAYERS.items()]
    sink = torch.zeros(1024, device=dev)
    print(f"{torch.cuda.get_device_name()}, {BLOCKS} blocks, µs per block (4 GEMMs)")
    for m in ms:
        inputs = {k: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for k in (1280, 5120)}

        def forward(kind=None, distance=1, programs=16):
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
        for kind, distance, programs in itertools.product(("load", "hint"), (1, 2), (8, 16, 32, 64)):
            results.append((replay_us(lambda: forward(kind, distance, programs)), kind, distance, programs))
        results.sort()
        best = ", ".join(f"{us:.1f} ({kind} d={d} p={p})" for us, kind, d, p in results[:4])
        worst = results[-1]
        print(f"M={m:5d} no prefetch {base:6.1f} | best: {best} | worst {worst[0]:.1f} ({worst[1]} d={worst[2]} p={worst[3]})",
              flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [256, 512, 1024, 2048])
