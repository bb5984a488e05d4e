"""FlashAttention 4's varlen forward in CUDA graphs with q, k, v as strided views of one packed
qkv (the fused forward's layout), as contiguous tensors, and with the copies that would make
them contiguous. Needs flash-attn-4 and a Hopper GPU. Log: results/h200-fa4-strides.log.
"""
import torch
from flash_attn.cute import flash_attn_varlen_func

from vitgraph.bench.common import graph_replay_us

H, D = 16, 80
LAYOUTS = {"1x4096": [4096], "4x1024": [1024] * 4, "16x256": [256] * 16, "1x9604": [9604]}
for name, lens in LAYOUTS.items():
    total = sum(lens)
    cu = torch.zeros(17, dtype=torch.int32)
    cu[1:len(lens) + 1] = torch.tensor(lens).cumsum(0)
    cu[len(lens) + 1:] = total
    cu = cu.cuda()
    qkv = torch.randn(total, 3 * H * D, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.view(total, 3, H, D).unbind(1)
    qc, kc, vc = (t.contiguous() for t in (q, k, v))

    def strided():
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=total, max_seqlen_k=total)[0]

    def contiguous():
        return flash_attn_varlen_func(qc, kc, vc, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=total, max_seqlen_k=total)[0]

    def copy_then_contiguous():
        a, b, c = (t.contiguous() for t in (q, k, v))
        return flash_attn_varlen_func(a, b, c, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=total, max_seqlen_k=total)[0]

    err = ((strided().float() - contiguous().float()).norm() / contiguous().float().norm()).item()
    row = {f.__name__: graph_replay_us(f, inner=4, reps=15)[0] for f in (strided, contiguous, copy_then_contiguous)}
    print(f"{name:8s} " + " | ".join(f"{k} {v:7.1f}" for k, v in row.items()) + f" | err {err:.0e}", flush=True)
