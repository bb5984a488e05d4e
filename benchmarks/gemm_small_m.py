"""Small-M GEMMs of the Qwen2-VL block inside CUDA graphs: cuBLAS (F.linear) against a Triton GEMM sweep."""
import sys, time
import torch, triton, triton.language as tl
import torch.nn.functional as F

from vitgraph.bench.common import graph_replay_us

@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GELU: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :]
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(x_ptrs, mask=rm[:, None] < M, other=0.0)
        b = tl.load(w_ptrs)
        acc = tl.dot(a, tl.trans(b), acc)
        x_ptrs += BK
        w_ptrs += BK
    acc += tl.load(b_ptr + rn)[None, :].to(tl.float32)
    if GELU:
        acc = acc * tl.sigmoid(1.702 * acc)
    tl.store(y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=rm[:, None] < M)

@triton.jit
def _linear_tma_kernel(x_desc, w_desc, b_ptr, y_desc, M, N, K,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GELU: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    om = pid_m * BM
    on = pid_n * BN
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in tl.range(0, K, BK):
        a = x_desc.load([om, k])
        b = w_desc.load([on, k])
        acc = tl.dot(a, b.T, acc)
    acc += tl.load(b_ptr + on + tl.arange(0, BN))[None, :].to(tl.float32)
    if GELU:
        acc = acc * tl.sigmoid(1.702 * acc)
    y_desc.store([om, on], acc.to(y_desc.dtype))

def alloc_fn(size, alignment, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)
triton.set_allocator(alloc_fn)

def triton_linear(x, w, b, y, cfg, gelu=False, tma=False):
    BM, BN, BK, stages, warps = cfg
    M, K = x.shape
    N = w.shape[0]
    grid = (triton.cdiv(N, BN), triton.cdiv(M, BM))
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        xd = TensorDescriptor.from_tensor(x, [BM, BK])
        wd = TensorDescriptor.from_tensor(w, [BN, BK])
        yd = TensorDescriptor.from_tensor(y, [BM, BN])
        _linear_tma_kernel[grid](xd, wd, b, yd, M, N, K, BM=BM, BN=BN, BK=BK, GELU=gelu, num_stages=stages, num_warps=warps)
    else:
        _linear_kernel[grid](x, w, b, y, M, N, K, BM=BM, BN=BN, BK=BK, GELU=gelu, num_stages=stages, num_warps=warps)
    return y

def graph_time(fn, reps=32, iters=20):
    return graph_replay_us(fn, inner=reps, reps=iters)[0]

SHAPES = {"qkv": (3840, 1280), "proj": (1280, 1280), "fc1": (5120, 1280), "fc2": (1280, 5120)}
CFGS = [(BM, BN, BK, st, w) for BM in (64, 128) for BN in (64, 128, 256) for BK in (64, 128) for st in (3, 4) for w in (4, 8)
        if not (BN == 256 and BK == 128 and st > 3)]
Ms = [int(m) for m in sys.argv[1:]] or [256, 512, 1024]
torch.manual_seed(0)
for M in Ms:
    tot_c = tot_t = 0
    for name, (N, K) in SHAPES.items():
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, w, b)
        tc = graph_time(lambda: F.linear(x, w, b))
        best = (1e9, None)
        t0 = time.time()
        for tma in (False, True):
            for cfg in CFGS:
                if M % cfg[0] and tma: continue
                try:
                    triton_linear(x, w, b, y, cfg, tma=tma)
                    err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                    if err > 1e-2: print("bad", cfg, err); continue
                    t = graph_time(lambda: triton_linear(x, w, b, y, cfg, tma=tma), reps=16, iters=10)
                except Exception:
                    continue
                if t < best[0]: best = (t, (cfg, tma))
        tot_c += tc; tot_t += best[0]
        flops = 2 * M * N * K
        print(f"M={M:5d} {name:5s} cublas {tc:6.2f} us ({flops/tc/1e6:4.0f} TF)  triton best {best[0]:6.2f} us {best[1]}  sweep {time.time()-t0:.0f}s", flush=True)
    print(f"M={M} block total: cublas {tot_c:.1f} us  triton {tot_t:.1f} us", flush=True)
