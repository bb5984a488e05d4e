"""cuDNN's fused attention over packed segments (ragged offsets + padding mask), through
the optional ``nvidia-cudnn-frontend`` package.

At head_dim 80 it beats FA2 varlen for packed buckets (benchmarks/HISTORY.md,
``benchmarks/attention_graphs.py``). A cuDNN graph is slow to build, so one is
built per fixed layout ``(segments, max_seqlen)`` and kept: the engine uses it only for
graph buckets, whose layout never changes; exact-shape eager calls keep FA2 varlen.
q, k and v are read in place from the packed ``qkv [T, 3, H, D]`` rows; segment
boundaries come from device tensors, so a captured graph follows new ``cu_seqlens``.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import threading

import torch

logger = logging.getLogger(__name__)
_INT_MAX = 2 ** 31 - 1  # batch stride of a ragged tensor: unused, offsets say where each segment starts
_lock = threading.Lock()
_handles: dict[int, object] = {}
_graphs: dict[tuple, "_RaggedGraph"] = {}


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """nvidia-cudnn-frontend imports (tried for real, once; installed but broken is a warning)."""
    if importlib.util.find_spec("cudnn") is None:
        return False
    try:
        import cudnn  # noqa: F401
    except Exception as err:  # a broken or incompatible install
        logger.warning("vitgraph: nvidia-cudnn-frontend is installed but failed to import (%s: %s); not using it",
                       type(err).__name__, err)
        return False
    return True


def _handle(device: torch.device):
    import cudnn

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _handles:
        with torch.cuda.device(index):
            _handles[index] = cudnn.create_handle()
    return _handles[index]


class _RaggedGraph:
    def __init__(self, segments: int, max_seqlen: int, heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        import cudnn

        self.handle = _handle(device)
        io = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}[dtype]
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=self.handle)
        dims = [segments, heads, max_seqlen, head_dim]

        def index_tensor(name, n):
            return g.tensor(name=name, dim=[n, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)

        self.q, self.k, self.v = (g.tensor(name=n, dim=dims, stride=[_INT_MAX, head_dim, 3 * heads * head_dim, 1],
                                           data_type=io) for n in "qkv")
        self.qkv_offsets = [index_tensor(f"{n}_offsets", segments + 1) for n in "qkv"]
        for t, offsets in zip((self.q, self.k, self.v), self.qkv_offsets):
            t.set_ragged_offset(offsets)
        self.out_offsets = index_tensor("o_offsets", segments + 1)
        self.seq_q, self.seq_kv = index_tensor("seq_q", segments), index_tensor("seq_kv", segments)
        o, _ = g.sdpa(name="sdpa", q=self.q, k=self.k, v=self.v, generate_stats=False, attn_scale=head_dim ** -0.5,
                      use_padding_mask=True, seq_len_q=self.seq_q, seq_len_kv=self.seq_kv)
        o.set_output(True).set_dim(dims).set_stride([_INT_MAX, head_dim, heads * head_dim, 1])
        o.set_ragged_offset(self.out_offsets)
        self.o = o
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.graph = g
        self.workspace_size = g.get_workspace_size()

    def __call__(self, qkv: torch.Tensor, meta: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        import cudnn

        q, k, v = qkv.unbind(1)
        pack = {self.q: q, self.k: k, self.v: v, self.o: out, self.out_offsets: meta["out_offsets"],
                self.seq_q: meta["seqlens"], self.seq_kv: meta["seqlens"]}
        for offsets in self.qkv_offsets:
            pack[offsets] = meta["qkv_offsets"]
        workspace = torch.empty(max(self.workspace_size, 1), device=qkv.device, dtype=torch.uint8)
        cudnn.set_stream(self.handle, torch.cuda.current_stream(qkv.device).cuda_stream)
        self.graph.execute(pack, workspace, handle=self.handle)
        return out


def ragged_metadata(cu_seqlens: torch.Tensor, heads: int, head_dim: int) -> dict[str, torch.Tensor]:
    """Element offsets and lengths from ``cu_seqlens``: computed once per forward, on the device."""
    return {"qkv_offsets": cu_seqlens * (3 * heads * head_dim), "out_offsets": cu_seqlens * (heads * head_dim),
            "seqlens": (cu_seqlens[1:] - cu_seqlens[:-1]).contiguous()}


def ragged_attention(qkv: torch.Tensor, meta: dict[str, torch.Tensor], max_seqlen: int) -> torch.Tensor:
    """Attention inside each segment of packed ``qkv [T, 3, H, D]`` -> ``[T, H, D]`` (padding rows unwritten)."""
    rows, _, heads, head_dim = qkv.shape
    segments = meta["seqlens"].shape[0]
    key = (segments, max_seqlen, heads, head_dim, qkv.dtype, qkv.device)
    with _lock:
        if key not in _graphs:
            _graphs[key] = _RaggedGraph(segments, max_seqlen, heads, head_dim, qkv.dtype, qkv.device)
        graph = _graphs[key]
    return graph(qkv, meta, torch.empty(rows, heads, head_dim, device=qkv.device, dtype=qkv.dtype))
