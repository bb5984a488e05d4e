"""Attention kernels at head_dim 80 as they run inside a CUDA graph (replay time, no launch cost).

For each bucket layout (bucket tokens, real segment lengths, 16 frame slots) it times:

* ``fa2-bucket``: FA2 varlen with the bucket's worst-case launch (16 slots, max_seqlen = tokens);
* ``fa2-tight``: FA2 varlen with exactly the real segments and their longest length;
* ``cudnn-torch``: torch's cuDNN ragged op (``aten._cudnn_attention_forward`` with cu_seqlens);
* ``cudnn-fe``: the same cuDNN ragged + padding-mask graph built once through cudnn-frontend
  (:mod:`vitgraph.ops.cudnn_attention`, the packed buckets' kernel);
* ``cudnn-dense``: cuDNN dense SDPA at the exact shape (an upper bound, single length only);
* ``fa4-bucket`` / ``fa4-tight`` / ``fa4-dense-exact``: FlashAttention 4's CuTe-DSL kernels
  (``flash_attn.cute``, package ``flash-attn-4``; Hopper and Blackwell), varlen with the
  bucket's launch or the real segments, and dense at the exact shape, when installed.

Each captured variant is checked against FA2 on the real rows, then the ``cu_seqlens``
buffer is rewritten with another layout and the same graph replayed and checked again
(proves the kernel reads segment boundaries from device memory).

    python benchmarks/attention_graphs.py
"""

import time
import traceback

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.varlen import varlen_attn

from vitgraph.bench.common import graph_replay_us as graph_us

H, D = 16, 80
SCALE = D ** -0.5
SLOTS = 16
dev = torch.device("cuda")


def cu_of(lens, slots):
    offs = [0]
    for n in lens:
        offs.append(offs[-1] + n)
    offs += [offs[-1]] * (slots + 1 - len(offs))
    return torch.tensor(offs, dtype=torch.int32, device=dev)


def ref_out(qkv, lens):
    cu = cu_of(lens, len(lens))
    return varlen_attn(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, max(lens), max(lens))[:sum(lens)]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


from vitgraph.ops import cudnn_attention  # noqa: E402

HAVE_CUDNN_FE = cudnn_attention.available()
print("cudnn-frontend:", "yes" if HAVE_CUDNN_FE else "not installed (pip install nvidia-cudnn-frontend)")
try:
    from flash_attn.cute import flash_attn_func as fa4_dense, flash_attn_varlen_func as fa4_varlen
except ImportError as exc:
    fa4_dense = fa4_varlen = None
    print(f"flash-attn-4: not installed ({exc})")


def first(result):
    return result[0] if isinstance(result, tuple) else result


CASES = [
    (256, [256]), (1024, [1024]), (1152, [1024]), (4096, [4096]), (4608, [4096]), (10240, [9604]),
    (4096, [1024] * 4), (4096, [256] * 16), (3584, [448] * 8), (4096, [900, 1200, 600, 1000]),
]


def other_layout(lens, tokens):
    """A different split of at most ``tokens`` rows into at most SLOTS segments."""
    if len(lens) == 1:
        n = lens[0]
        return [n // 3, n - n // 3 - 5]
    return list(reversed(lens[1:])) + [max(1, lens[0] // 2)]


rows = []
for tokens, lens in CASES:
    name = f"{len(lens)}x{max(lens)} in {tokens}"
    qkv = torch.randn(tokens, 3, H, D, device=dev, dtype=torch.bfloat16)
    qkv[sum(lens):] = float("nan")  # padding rows must never leak
    cu = cu_of(lens, SLOTS)
    real = sum(lens)
    ref = ref_out(qkv, lens)
    flops = sum(4 * n * n * H * D for n in lens)
    alt = other_layout(lens, tokens)

    def check_dynamic(fn_out, g):
        cu.copy_(cu_of(alt, SLOTS))
        g.replay()
        torch.cuda.synchronize()
        err = rel(fn_out()[:sum(alt)], ref_out(qkv, alt))
        cu.copy_(cu_of(lens, SLOTS))
        return err

    variants = {}
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    out_fa = {}
    variants["fa2-bucket"] = lambda: out_fa.__setitem__("o", varlen_attn(q, k, v, cu, cu, tokens, tokens))
    cu_t = cu_of(lens, len(lens))
    variants["fa2-tight"] = lambda: out_fa.__setitem__("t", varlen_attn(q, k, v, cu_t, cu_t, max(lens), max(lens)))
    for label, fn in variants.items():
        try:
            us, g = graph_us(fn)
            key = "o" if label == "fa2-bucket" else "t"
            err = rel(out_fa[key][:real], ref)
            dyn = check_dynamic(lambda: out_fa[key], g) if label == "fa2-bucket" else None
            rows.append((name, label, us, flops / us / 1e6, err, dyn, None))
            del g
        except Exception as exc:
            rows.append((name, label, None, None, None, None, f"{type(exc).__name__}: {str(exc)[:80]}"))

    if fa4_varlen is not None:
        fa4_variants = {
            "fa4-bucket": (lambda: first(fa4_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=tokens,
                                                    max_seqlen_k=tokens, softmax_scale=SCALE)), True),
            "fa4-tight": (lambda: first(fa4_varlen(q, k, v, cu_seqlens_q=cu_t, cu_seqlens_k=cu_t,
                                                   max_seqlen_q=max(lens), max_seqlen_k=max(lens),
                                                   softmax_scale=SCALE)), False),
        }
        for label, (fn, dynamic) in fa4_variants.items():
            box = {}
            try:
                t0 = time.perf_counter()
                fn()  # compiles the kernel the first time
                torch.cuda.synchronize()
                first_ms = (time.perf_counter() - t0) * 1e3
                us, g = graph_us(lambda: box.__setitem__("o", fn()))
                err = rel(box["o"][:real], ref)
                dyn = check_dynamic(lambda: box["o"], g) if dynamic else None
                rows.append((name, label, us, flops / us / 1e6, err, dyn, f"first call {first_ms:.0f} ms"))
                del g
            except Exception as exc:
                traceback.print_exc()
                rows.append((name, label, None, None, None, None, f"{type(exc).__name__}: {str(exc)[:80]}"))

    # torch's cuDNN ragged op
    try:
        box = {}
        t0 = time.perf_counter()
        torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, tokens, tokens, False, scale=SCALE)
        torch.cuda.synchronize()
        eager_ms = (time.perf_counter() - t0) * 1e3

        def cd():
            box["o"] = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, tokens, tokens, False,
                                                               scale=SCALE)[0]
        us, g = graph_us(cd)
        err = rel(box["o"][:real], ref)
        dyn = check_dynamic(lambda: box["o"], g)
        rows.append((name, "cudnn-torch", us, flops / us / 1e6, err, dyn, f"eager call {eager_ms:.0f} ms"))
        del g
    except Exception as exc:
        rows.append((name, "cudnn-torch", None, None, None, None, f"{type(exc).__name__}: {str(exc)[:80]}"))

    if HAVE_CUDNN_FE:
        for label, slots, smax in [("cudnn-fe", SLOTS, tokens), ("cudnn-fe-tight", len(lens), max(lens))]:
            try:
                box = {}
                cu_use = cu if slots == SLOTS else cu_of(lens, slots)

                def fe():
                    meta = cudnn_attention.ragged_metadata(cu_use, H, D)
                    box["o"] = cudnn_attention.ragged_attention(qkv, meta, smax)

                t0 = time.perf_counter()
                fe()  # builds the cuDNN graph for this layout
                torch.cuda.synchronize()
                build_ms = (time.perf_counter() - t0) * 1e3
                us, g = graph_us(fe)
                err = rel(box["o"][:real], ref)
                dyn = check_dynamic(lambda: box["o"], g) if slots == SLOTS else None
                rows.append((name, label, us, flops / us / 1e6, err, dyn, f"build {build_ms:.0f} ms"))
                del g
            except Exception as exc:
                traceback.print_exc()
                rows.append((name, label, None, None, None, None, f"{type(exc).__name__}: {str(exc)[:80]}"))

    if len(lens) == 1:  # dense over the whole padded bucket, padding keys masked by an extra lane
        from vitgraph.ops.attention import LANE_PAD, dense_masked
        from vitgraph.ops.kernels import PAD_KEY_SCORE

        box = {}
        qd = torch.zeros(tokens, H, D + LANE_PAD, device=dev, dtype=torch.bfloat16)
        kd = torch.zeros_like(qd)
        qd[:real, :, :D], kd[:real, :, :D] = q[:real], k[:real]
        qd[:, :, D] = 1
        kd[real:, :, D] = PAD_KEY_SCORE
        vz = v.clone()
        vz[real:] = 0
        try:
            us, g = graph_us(lambda: box.__setitem__("o", dense_masked(qd, kd, vz, SCALE)))
            err = rel(box["o"][:real], ref)
            rows.append((name, "cudnn-dense-lane", us, flops / us / 1e6, err, None, None))
            del g
        except Exception as exc:
            rows.append((name, "cudnn-dense-lane", None, None, None, None, f"{type(exc).__name__}: {str(exc)[:80]}"))
    if len(set(lens)) == 1:
        n = lens[0]
        qd, kd, vd = (qkv[:real, i].reshape(len(lens), n, H, D).transpose(1, 2) for i in range(3))
        box = {}
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                us, g = graph_us(lambda: box.__setitem__("o", F.scaled_dot_product_attention(qd, kd, vd)))
            err = rel(box["o"].transpose(1, 2).reshape(real, H, D), ref)
            rows.append((name, "cudnn-dense-exact", us, flops / us / 1e6, err, None, None))
            del g
        except Exception as exc:
            rows.append((name, "cudnn-dense-exact", None, None, None, None, f"{type(exc).__name__}: {str(exc)[:80]}"))
        if fa4_dense is not None:
            qb, kb, vb = (qkv[:real, i].reshape(len(lens), n, H, D) for i in range(3))
            box = {}
            try:
                us, g = graph_us(lambda: box.__setitem__("o", first(fa4_dense(qb, kb, vb, softmax_scale=SCALE))))
                err = rel(box["o"].reshape(real, H, D), ref)
                rows.append((name, "fa4-dense-exact", us, flops / us / 1e6, err, None, None))
                del g
            except Exception as exc:
                traceback.print_exc()
                rows.append((name, "fa4-dense-exact", None, None, None, None, f"{type(exc).__name__}: {str(exc)[:80]}"))
    qkv = q = k = v = None  # free this case's tensors (the closures above are done with them)
    torch.cuda.empty_cache()

print(f"{'layout':<26}{'kernel':<20}{'us':>9}{'TFLOP/s':>9}{'err':>10}{'dyn err':>10}  note")
for name, label, us, tf, err, dyn, note in rows:
    f = lambda x, fmt: (fmt % x) if x is not None else "-"
    print(f"{name:<26}{label:<20}{f(us, '%9.1f'):>9}{f(tf, '%9.0f'):>9}{f(err, '%10.1e'):>10}"
          f"{f(dyn, '%10.1e'):>10}  {note or ''}")
