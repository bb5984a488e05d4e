"""Attention kernels at head_dim 80 as they run inside a CUDA graph (replay time, no launch cost).

For each bucket layout (bucket tokens, real segment lengths, 16 frame slots) it times:

* ``fa2-bucket``: FA2 varlen with the bucket's worst-case launch (16 slots, max_seqlen = tokens);
* ``fa2-tight``: FA2 varlen with exactly the real segments and their longest length;
* ``cudnn-torch``: torch's cuDNN ragged op (``aten._cudnn_attention_forward`` with cu_seqlens);
* ``cudnn-fe``: the same cuDNN ragged + padding-mask graph built once through cudnn-frontend;
* ``cudnn-dense``: cuDNN dense SDPA at the exact shape (an upper bound, single length only).

Each captured variant is checked against FA2 on the real rows, then the ``cu_seqlens``
buffer is rewritten with another layout and the same graph replayed and checked again
(proves the kernel reads segment boundaries from device memory).

    python benchmarks/attention_graphs.py
"""

import statistics
import time
import traceback

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.varlen import varlen_attn

H, D = 16, 80
SCALE = D ** -0.5
SLOTS = 16
dev = torch.device("cuda")
INT_MAX = 2 ** 31 - 1


def graph_us(fn, inner=10, reps=15):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / inner)
    return statistics.median(times), g


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


try:
    import cudnn  # nvidia-cudnn-frontend

    HANDLE = cudnn.create_handle()
    print("cudnn-frontend", getattr(cudnn, "__version__", "?"), "backend", cudnn.backend_version())
except Exception as exc:  # optional
    cudnn = None
    print("no cudnn-frontend:", exc)


class FrontendRagged:
    """cuDNN SDPA over packed [T, 3, H, D] qkv with ragged offsets and a padding mask."""

    def __init__(self, slots, smax):
        t0 = time.perf_counter()
        g = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=HANDLE)
        dims = [slots, H, smax, D]
        mk = lambda name, stride: g.tensor(name=name, dim=dims, stride=stride, data_type=cudnn.data_type.BFLOAT16)
        self.q, self.k, self.v = (mk(n, [INT_MAX, D, 3 * H * D, 1]) for n in "qkv")
        off = lambda name: g.tensor(name=name, dim=[slots + 1, 1, 1, 1], stride=[1, 1, 1, 1],
                                    data_type=cudnn.data_type.INT32)
        self.rq, self.rk, self.rv, self.ro = (off(n) for n in ("rq", "rk", "rv", "ro"))
        self.q.set_ragged_offset(self.rq)
        self.k.set_ragged_offset(self.rk)
        self.v.set_ragged_offset(self.rv)
        lens = lambda name: g.tensor(name=name, dim=[slots, 1, 1, 1], stride=[1, 1, 1, 1],
                                     data_type=cudnn.data_type.INT32)
        self.sq, self.skv = lens("sq"), lens("skv")
        kwargs = dict(name="sdpa", q=self.q, k=self.k, v=self.v, attn_scale=SCALE, use_padding_mask=True,
                      seq_len_q=self.sq, seq_len_kv=self.skv)
        try:
            o, _ = g.sdpa(is_inference=True, **kwargs)
        except TypeError:
            o, _ = g.sdpa(generate_stats=False, **kwargs)
        o.set_output(True).set_dim(dims).set_stride([INT_MAX, D, H * D, 1]).set_ragged_offset(self.ro)
        self.o = o
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.g = g
        self.ws = torch.empty(max(g.get_workspace_size(), 1), device=dev, dtype=torch.uint8)
        self.build_s = time.perf_counter() - t0

    def __call__(self, qkv, out, cu):
        # offsets in elements; lengths per slot
        self.tmp = (cu * (3 * H * D), cu * (H * D), (cu[1:] - cu[:-1]).contiguous())
        roff, ooff, seqlen = self.tmp
        cudnn.set_stream(HANDLE, torch.cuda.current_stream().cuda_stream)
        self.g.execute({self.q: qkv[:, 0], self.k: qkv[:, 1], self.v: qkv[:, 2], self.o: out,
                        self.rq: roff, self.rk: roff, self.rv: roff, self.ro: ooff,
                        self.sq: seqlen, self.skv: seqlen}, self.ws, handle=HANDLE)
        return out


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

    if cudnn is not None:
        for label, slots, smax in [("cudnn-fe", SLOTS, tokens), ("cudnn-fe-tight", len(lens), max(lens))]:
            try:
                fe = FrontendRagged(slots, smax)
                out = torch.full((tokens, H, D), float("nan"), device=dev, dtype=torch.bfloat16)
                cu_use = cu if slots == SLOTS else cu_of(lens, slots)
                us, g = graph_us(lambda: fe(qkv, out, cu_use))
                err = rel(out[:real], ref)
                dyn = check_dynamic(lambda: out, g) if slots == SLOTS else None
                rows.append((name, label, us, flops / us / 1e6, err, dyn, f"build {fe.build_s * 1e3:.0f} ms"))
                del g
            except Exception as exc:
                traceback.print_exc()
                rows.append((name, label, None, None, None, None, f"{type(exc).__name__}: {str(exc)[:80]}"))

    if len(lens) == 1:  # dense over the whole padded bucket, padding keys masked by an extra lane
        from vitgraph.attention import LANE_PAD, dense_masked
        from vitgraph.kernels import PAD_KEY_SCORE

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
    del qkv
    torch.cuda.empty_cache()

print(f"{'layout':<26}{'kernel':<20}{'us':>9}{'TFLOP/s':>9}{'err':>10}{'dyn err':>10}  note")
for name, label, us, tf, err, dyn, note in rows:
    f = lambda x, fmt: (fmt % x) if x is not None else "-"
    print(f"{name:<26}{label:<20}{f(us, '%9.1f'):>9}{f(tf, '%9.0f'):>9}{f(err, '%10.1e'):>10}"
          f"{f(dyn, '%10.1e'):>10}  {note or ''}")
