"""How an encoder buckets, captures and runs (:class:`EngineOptions`), and what follows from
the options, the device and the tower: its backends and its buckets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from ..engine.planner import Bucket, budget_ladder, make_buckets
from ..engine.contract import VisionTower
from ..ops import kernels
from ..ops.attention import fa4_short_cap, resolve_backend
from ..ops.backend_names import PRECISIONS, attention_backend
from ..ops.gemm import GEMM_BACKENDS, resolve_gemm
from .tuning import Tuning, check_overrides
from .validation import check_int

MODES = ("auto", "graph", "eager")


@dataclass
class EngineOptions:
    """How the encoder buckets, captures and runs. Every field is validated."""

    mode: str = "auto"  # "auto": graphs on CUDA, eager elsewhere
    budgets: Sequence[int] | None = None  # patch-token budgets; None = automatic ladder
    min_budget: int = 256
    max_budget: int = 16384
    max_items: int = 16  # most segments (frames) one replay holds; each empty slot costs attention launch slots
    attention: str = "auto"  # "auto" | "fa4" | "cudnn" | "varlen" | "flash" | "sdpa"
    fuse: bool | None = None  # Triton kernels for the elementwise work; None = on CUDA in fp16/bf16 with triton
    gemm: str = "auto"  # "quack" (qkv + rotary, the MLP in + activation as one GEMM each; Hopper, bf16) | "cublas"; auto = quack where it runs
    # The blocks' four GEMMs: "bf16" (the weights' dtype) or "fp8" (weights per channel or a per-tensor
    # FP8 checkpoint's own, activations per row, torch._scaled_mm; the fused forward; vitgraph.ops.fp8;
    # only the e4m3 weights kept); the merger stays in the weights' dtype.
    precision: str = "bf16"
    # One frame above this runs eagerly at its exact shape (GPU-bound there), as does a step its
    # bucket would pad by EAGER_MIN_PADDING (vitgraph.engine.planner) or more. None: never.
    exact_eager_above: int | None = 8192
    capture: bool = True  # capture on construction; else call encoder.capture()
    # Where FlashAttention 4's or quack's kernel caches are cold, compile those kernels in up to
    # this many worker processes before capture (None: automatic; 0: none, capture compiles them).
    compile_workers: int | None = None
    pool_limit_bytes: int | None = None
    progress: bool = True
    # submit()'s front: the longest a ready request waits for others to share its replay while
    # the device is busy (an idle device takes it at once).
    max_wait_ms: float = 2.0
    # Threads that decode and preprocess submit_images' requests (None: min(2, CPUs)): each holds
    # Python's lock while it launches preprocessing, and more of them starve the scheduler.
    front_threads: int | None = None
    # The second tier: changes to the tuning derived from the device and the tower, by dotted
    # name ({"buckets.dense": False, "gemm.split_k_max_rows": 0}; see vitgraph.runtime.tuning).
    tuning: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("min_budget", "max_budget", "max_items"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("pool_limit_bytes", self.pool_limit_bytes, minimum=1, optional=True)
        check_int("exact_eager_above", self.exact_eager_above, minimum=0, optional=True)
        check_int("compile_workers", self.compile_workers, minimum=0, optional=True)
        check_int("front_threads", self.front_threads, minimum=1, optional=True)
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.precision == "fp8" and self.gemm == "quack":
            raise ValueError("precision='fp8' runs its GEMMs on cuBLAS (torch._scaled_mm): use gemm='auto' or 'cublas'")
        if self.precision == "fp8" and self.fuse is False:
            raise ValueError("precision='fp8' runs in the fused forward: use fuse=True or None")
        if self.gemm not in ("auto",) + GEMM_BACKENDS:
            raise ValueError(f"gemm must be 'auto' or one of {GEMM_BACKENDS}, got {self.gemm!r}")
        if self.fuse is not None and not isinstance(self.fuse, bool):
            raise ValueError(f"fuse must be True, False or None (auto), got {self.fuse!r}")
        if not isinstance(self.capture, bool):  # not "in (True, False)": 1 == True
            raise ValueError(f"capture must be True or False, got {self.capture!r}")
        if (isinstance(self.max_wait_ms, bool) or not isinstance(self.max_wait_ms, (int, float))
                or not 0 <= self.max_wait_ms <= 60_000):
            raise ValueError(f"max_wait_ms must be a number of milliseconds in [0, 60000], got {self.max_wait_ms!r}")
        if self.tuning is not None:
            check_overrides(self.tuning)
        if self.budgets is not None and (isinstance(self.budgets, (str, bytes)) or not isinstance(self.budgets, Sequence)
                                         or len(self.budgets) == 0
                                         or any(isinstance(b, bool) or not isinstance(b, int) for b in self.budgets)):
            raise ValueError(f"budgets must be a non-empty list of ints or None, got {self.budgets!r}")


# Options that became tuning settings, named in the error for a caller who still passes them.
MOVED_TO_TUNING = {"dense_buckets": "buckets.dense", "dense_max_tokens": "buckets.dense_max_tokens",
                   "short_frame_buckets": "buckets.short_frames", "route_single_frames": "routing.single_frames",
                   "route_to_faster_buckets": "routing.faster_buckets"}


def engine_options(options: Mapping[str, Any]) -> EngineOptions:
    """:class:`EngineOptions` from keyword options; a ``TypeError`` naming an unknown one."""
    known = {f.name for f in dataclasses.fields(EngineOptions)}
    for name in options:
        if name in MOVED_TO_TUNING:
            raise TypeError(f"{name} is a tuning setting: pass tuning={{{MOVED_TO_TUNING[name]!r}: ...}}")
        if name not in known:
            raise TypeError(f"unknown option {name!r}; the options are {', '.join(sorted(known))}")
    return EngineOptions(**options)


def dense_limit(options: EngineOptions, attention: str, tuning: Tuning) -> int | None:
    """Tokens of the largest dense bucket to capture (None: no limit; 0: none)."""
    chosen = tuning.buckets.dense_max_tokens
    if not tuning.buckets.dense or (chosen is None and attention_backend(attention).tiles):
        return 0  # FA4's packed buckets (its tiles) win for single frames
    limits = [n for n in (options.exact_eager_above, chosen) if n is not None]
    return min(limits) if limits else None


def short_cap_rule(options: EngineOptions, backend: str, heads: int, device: torch.device,
                   unit: int, tuning: Tuning) -> Callable[[int], int | None] | None:
    """``budget -> frame cap`` of the short-frame bucket to capture for it (None: none)."""
    if (not tuning.buckets.short_frames or not attention_backend(backend).tiles or device.type != "cuda"
            or not tuning.attention.choose_tiles):
        return None
    return lambda budget: fa4_short_cap(budget, heads, unit, tuning.attention)


def check_fp8_device(device: torch.device) -> None:
    """FP8 GEMMs run on CUDA devices of compute capability 8.9 or more (Ada, Hopper), and on a CPU
    (torch's own kernel: slow, for tests)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"precision='fp8' needs a GPU of compute capability 8.9 or more (FP8 tensor cores); "
                         f"{device} has {torch.cuda.get_device_capability(device)}")


def configure_tower(tower: VisionTower, options: EngineOptions, tuning: Tuning, device: torch.device,
                    dtype: torch.dtype) -> tuple[str, Tuning]:
    """Set ``tower``'s attention backend, fusion, GEMM backend and kernel tuning as ``options``
    and ``tuning`` ask (resolving "auto" for ``device`` and ``dtype``); returns the attention
    backend and the tuning with the GEMM backend chosen."""
    attention = resolve_backend(options.attention, device, dtype)
    fuse = options.fuse
    if fuse is None:
        fuse = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and kernels.usable(device)
    if options.gemm not in ("auto", "cublas") and options.gemm not in tower.gemm_backends:
        raise ValueError(f"gemm={options.gemm!r}: the {type(tower).__name__} has no {options.gemm} GEMM path; "
                         f"use 'cublas' or 'auto'")
    quack = fuse and "quack" in tower.gemm_backends and options.precision != "fp8"
    gemm = resolve_gemm(options.gemm, device, dtype, quack)
    if options.precision == "fp8":
        check_fp8_device(device)
        if dtype == torch.float16:
            raise ValueError("precision='fp8' gives its GEMMs' results in bf16: use dtype bf16 (or fp32 on a CPU)")
        if not fuse:
            raise ValueError(f"precision='fp8' runs in the fused forward: on a CUDA device with triton (on a CPU, "
                             f"fuse=True under TRITON_INTERPRET=1); got device {device}, fuse {options.fuse}")
    tuning = dataclasses.replace(tuning, gemm=dataclasses.replace(tuning.gemm, backend=gemm))
    # refuses fuse=True where the kernels cannot run, and FP8 for widths _scaled_mm does not take
    precision = {} if options.precision == "bf16" else {"precision": options.precision}  # towers without FP8 take 3
    tower.configure(attention, fuse, tuning.kernels, **precision)
    return attention, tuning


def buckets_for(tower: VisionTower, options: EngineOptions, attention: str,
                device: torch.device, tuning: Tuning) -> list[Bucket]:
    """The buckets an encoder with these options asks to capture."""
    budgets = options.budgets
    if budgets is None:
        budgets = budget_ladder(options.min_budget, options.max_budget, align=tower.merge_unit)
    limit = dense_limit(options, attention, tuning)
    return make_buckets(list(budgets), options.max_items, tower.merge_unit, dense=limit != 0, dense_up_to=limit,
                        short_cap=short_cap_rule(options, attention, tower.shape.num_heads, device,
                                                 tower.merge_unit, tuning))


def uses_graphs(options: EngineOptions, device: torch.device) -> bool:
    return options.mode == "graph" or (options.mode == "auto" and device.type == "cuda")


def resolve_device(device) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device {device!r} is not a valid torch device: {err}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device} was requested but CUDA is not available")
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {device} does not exist ({torch.cuda.device_count()} CUDA device(s))")
        return torch.device("cuda", index)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device}")
    return device


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        named = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                 "float16": torch.float16, "half": torch.float16, "fp32": torch.float32, "float32": torch.float32}
        if dtype not in named:
            raise ValueError(f"dtype must be one of {sorted(named)}, got {dtype!r}")
        return named[dtype]
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    return dtype
