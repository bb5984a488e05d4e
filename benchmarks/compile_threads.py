"""Do the first-use compiles of the default kernels overlap when started from threads?

    TRITON_CACHE_DIR=$(mktemp -d) FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$(mktemp -d) \
        QUACK_CACHE_DIR=$(mktemp -d) python benchmarks/compile_threads.py serial    # or: threads

Compiles FA4's varlen kernel (4096 tokens in 16 slots), quack's fc1 + QuickGELU and qkv GEMMs,
and vitgraph's six Triton kernel variants, one after another or each from its own thread,
and prints the wall time of each and of all. Needs the ``fa4`` extra and a Hopper GPU.
"""
import sys
import time
from concurrent.futures import ThreadPoolExecutor
import torch
from vitgraph.ops import kernels, gemm
from vitgraph.ops.attention import _fa4_forward
t0 = time.perf_counter()
gemm._quack(); fa4 = _fa4_forward()
print(f"imports {time.perf_counter()-t0:.1f}s", flush=True)
dev = "cuda"; T, H, D = 4096, 16, 80
x = torch.randn(T, 1280, device=dev, dtype=torch.bfloat16)
w1 = torch.randn(5120, 1280, device=dev, dtype=torch.bfloat16) * .03; b1 = torch.zeros(5120, device=dev, dtype=torch.bfloat16)
w3 = torch.randn(3840, 1280, device=dev, dtype=torch.bfloat16) * .03; b3 = torch.zeros(3840, device=dev, dtype=torch.bfloat16)
qkv = torch.randn(T, 3 * H * D, device=dev, dtype=torch.bfloat16)
cos = torch.randn(T, D, device=dev); sin = torch.randn(T, D, device=dev)
seg = torch.zeros(T, device=dev, dtype=torch.int32)
cu = torch.tensor([0, T] + [T] * 15, device=dev, dtype=torch.int32)
lnw = torch.ones(1280, device=dev, dtype=torch.bfloat16); lnb = torch.zeros(1280, device=dev, dtype=torch.bfloat16)
units = {
    "fa4": lambda: fa4(qkv[:, :1280].reshape(T, H, D), qkv[:, 1280:2560].reshape(T, H, D), qkv[:, 2560:].reshape(T, H, D),
                       cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=T, max_seqlen_k=T),
    "quack_fc1": lambda: gemm.linear_quick_gelu(x, w1, b1, "quack"),
    "quack_qkv": lambda: gemm.linear_qkv(x, w3, b3, "quack"),
    "triton": lambda: (kernels.add_layernorm(x.clone(), x, lnw, lnb, 1e-6), kernels.add_layernorm(x.clone(), None, lnw, lnb, 1e-6),
                       kernels.rotary_(qkv.clone(), cos, sin, H), kernels.rotary_(qkv.clone(), cos, sin, H, seg, zero_padding=True),
                       kernels.rotary_(qkv.clone(), cos, sin, H, seg, 88), kernels.quick_gelu_(x.clone())),
}
def timed(name):
    s = time.perf_counter(); units[name](); torch.cuda.synchronize(); return name, time.perf_counter() - s
s = time.perf_counter()
if sys.argv[1] == "threads":
    with ThreadPoolExecutor(len(units)) as ex:
        res = list(ex.map(timed, units))
else:
    res = [timed(n) for n in units]
print(sys.argv[1], f"wall {time.perf_counter()-s:.1f}s", " ".join(f"{n} {t:.1f}s" for n, t in res), flush=True)
