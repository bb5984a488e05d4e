"""Attention kernels at head_dim 80 on one GPU: how launch shape (segments x max_seqlen) and the
kernel choice cost, per layer. Used to pick the per-bucket attention layout.

    python benchmarks/attention_micro.py
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.varlen import varlen_attn

from vitgraph.bench import common  # noqa: E402

H, D = 16, 80
dev = torch.device("cuda")


def varlen_case(tokens, real_segments, seg_len, slots, max_seqlen):
    q, k, v = (torch.randn(tokens, H, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    cu = torch.full((slots + 1,), real_segments * seg_len, dtype=torch.int32, device=dev)
    cu[:real_segments + 1] = torch.arange(real_segments + 1, device=dev, dtype=torch.int32) * seg_len
    return common.median_ms(lambda: varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen), dev, 50, 5)


def dense_case(tokens, backend, key_pad=0):
    q, k, v = (torch.randn(1, H, tokens, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    mask = None
    if key_pad:
        mask = torch.zeros(1, 1, 1, tokens, device=dev, dtype=torch.bfloat16)
        mask[..., tokens - key_pad:] = float("-inf")
    try:
        with sdpa_kernel([backend]):
            return common.median_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), dev, 50, 5)
    except RuntimeError as err:
        return f"n/a ({str(err).splitlines()[0][:60]})"


rows = []
for tokens, segs, seg_len in [(1024, 1, 1024), (4096, 4, 1024), (4096, 16, 256), (4096, 1, 4096), (9728, 1, 9604)]:
    real = segs * seg_len
    for slots, max_seqlen in [(segs, seg_len), (64, tokens), (segs, tokens), (1, tokens)]:
        if slots < segs:
            continue
        ms = varlen_case(tokens, segs, seg_len, slots, max_seqlen)
        flops = 4 * segs * seg_len ** 2 * H * D
        rows.append([f"varlen {segs}x{seg_len} in {tokens}", slots, max_seqlen, ms * 1e3, flops / ms / 1e9])
for tokens in (1024, 4096, 9604):
    for name, backend in [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
        for pad in (0, tokens // 8):
            ms = dense_case(tokens, backend, pad)
            flops = 4 * (tokens - pad) ** 2 * H * D
            rows.append([f"sdpa-{name} 1x{tokens} keypad {pad}", 1, tokens,
                         ms * 1e3 if isinstance(ms, float) else ms,
                         flops / ms / 1e9 if isinstance(ms, float) else None])


def cudnn_ragged_case(tokens, real_segments, seg_len, slots):
    """cuDNN's ragged (THD) path, which torch's varlen_attn leaves switched off: time it and
    check it against FA2 varlen on the same padded layout."""
    q, k, v = (torch.randn(tokens, H, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    cu = torch.full((slots + 1,), real_segments * seg_len, dtype=torch.int32, device=dev)
    cu[:real_segments + 1] = torch.arange(real_segments + 1, device=dev, dtype=torch.int32) * seg_len
    real = real_segments * seg_len

    def run():
        return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, tokens, tokens, False)[0]

    try:
        out = run()
        ref = varlen_attn(q, k, v, cu, cu, tokens, tokens)
        err = common.rel_err(out[:real].float(), ref[:real].float())
        return common.median_ms(run, dev, 50, 5), err
    except Exception as exc:  # report, never abort the sweep
        return f"n/a ({type(exc).__name__}: {str(exc).splitlines()[0][:50]})", None


for tokens, segs, seg_len, slots in [(4608, 1, 4096, 1), (4096, 4, 1024, 16), (4096, 16, 256, 16),
                                     (10496, 1, 9604, 1), (1152, 1, 1024, 16)]:
    ms, err = cudnn_ragged_case(tokens, segs, seg_len, slots)
    flops = 4 * segs * seg_len ** 2 * H * D
    label = f"cudnn-ragged {segs}x{seg_len} in {tokens}" + (f" (rel err vs FA2 {err:.1e})" if err is not None else "")
    rows.append([label, slots, tokens, ms * 1e3 if isinstance(ms, float) else ms,
                 flops / ms / 1e9 if isinstance(ms, float) else None])
common.print_table(["kernel", "segments", "max_seqlen", "us/layer", "TFLOP/s"], rows)
