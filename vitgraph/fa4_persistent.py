"""FlashAttention 4's Hopper varlen forward with persistent CTAs, for vitgraph's short tiles.

FA4's Hopper kernel is written as a loop over work tiles, but its varlen scheduler hands each
CTA one (query tile, head, segment) and ends it. On packed buckets of short frames (``16x256``:
512 tiles of 128 rows) much of a CTA's life is then launch, prologue and epilogue. Here the
grid is capped at the SM count and each CTA strides over the same tile numbering. FA4 stores
O through Q's shared memory; a CTA that moves on to another tile loads the next Q while its
consumers still store O, so here O gets shared memory of its own where it fits (else the
producer waits at a named barrier between tiles until O is stored). The tile math is FA4's
own: the output is bitwise the same.

How it plugs in, for the pinned ``flash-attn-4`` release of the ``fa4`` extra: FA4's Hopper
forward picks its varlen scheduler from a module global, builds its shared-memory struct in
``_get_shared_storage_cls``, stores O in ``epilogue`` and keeps compiled kernels in
``_flash_attn_fwd.compile_cache``. :func:`install` replaces these, once, with versions that
behave exactly as FA4's own unless the calling thread is inside :func:`persistent_tiles`;
there the scheduler is the persistent one, O has its own buffer, and kernels live in a cache
of their own (on disk beside FA4's), so a process can hold both kernels of one shape.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import logging
import threading

from .lazy_dynamo import import_quack

logger = logging.getLogger(__name__)

# The flash-attn-4 release whose internals this module replaces (the ``fa4`` extra's pin);
# with any other, vitgraph keeps FA4's own scheduler (see supported()).
TESTED_FA4 = "4.0.0b18"
TILE_BARRIER = 8  # a named barrier FA4's Hopper forward leaves free (it uses 1-6)
# O in shared memory of its own (read when a kernel is compiled): the producer loads the next
# tile's Q while the consumers store O, instead of waiting at TILE_BARRIER for them.
OWN_O_SMEM = True
# FA4's loops step the scheduler (advance_to_next_work), then ask it for the tile
# (get_current_work), and ignore what the step returned. Stock, the step maps the new tile
# index to (block, head, segment) too: warp shuffles over cu_seqlens that the compiler keeps,
# about 0.3-0.4 µs per tile. True: the step only moves the index, so each tile is mapped once
# (h200-fa4-stages-lean.log, h200-fa4-lean-again.log, µs per call, bitwise equal: 16x256
# 25.0 -> 23.6 and 24.9 -> 23.3, 8x448 33.3 -> 31.6 and 33.2 -> 32.0, 4x1024 52.8 -> 52.1 and
# 53.3 -> 51.7). Read when a kernel is compiled; False for A/Bs.
LEAN_ADVANCE = True
CACHE_NAME = "vitgraph-persistent-varlen-v3"  # bump when the kernel changes
SM90_SMEM_BYTES = 227 * 1024  # an H100's or H200's shared memory per CTA

# .active: this thread is inside persistent_tiles; .own_o: the kernel being traced on this
# thread keeps O in its own shared memory (set by its storage struct, read by its scheduler).
_state = threading.local()
_install_lock = threading.Lock()
_installed = False


def _active() -> bool:
    return getattr(_state, "active", False)


@functools.cache
def supported() -> bool:
    """Whether the installed flash-attn-4 is the release this module was written and tested
    against. Its replacements reach into FA4's internals, which other releases may change."""
    try:
        version = importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version != TESTED_FA4:
        logger.warning("vitgraph: flash-attn-4 %s is not the tested %s; its short tiles keep FA4's own "
                       "scheduler (no persistent CTAs)", version, TESTED_FA4)
    return version == TESTED_FA4


def _cache_name() -> str:
    return CACHE_NAME + ("" if OWN_O_SMEM else "-shared-o") + ("" if LEAN_ADVANCE else "-mapping-advance")


@contextlib.contextmanager
def persistent_tiles():
    """FA4 calls made by this thread inside the block use (and compile) the persistent kernel."""
    install()
    with _routed_here():
        yield


@contextlib.contextmanager
def _routed_here():
    before = _active()
    _state.active = True
    try:
        yield
    finally:
        _state.active = before


class _ThreadRoutedCache:
    """FA4's compile cache for every caller, except threads inside :func:`persistent_tiles`:
    they get ``persistent(name)``, the cache of the kernel variant now in force."""

    def __init__(self, stock, persistent) -> None:
        self.stock, self.persistent = stock, persistent

    def _pick(self):
        return self.persistent(_cache_name()) if _active() else self.stock

    def __contains__(self, key) -> bool:
        return key in self._pick()

    def __getitem__(self, key):
        return self._pick()[key]

    def __setitem__(self, key, fn) -> None:
        self._pick()[key] = fn

    def __getattr__(self, name):  # clear() and the rest: FA4's own cache
        return getattr(self.stock, name)


def _persistent_scheduler_class(stock):
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils
    from cutlass import Int32

    class PersistentVarlenScheduler(stock):
        """FA4's varlen scheduler; persistent when traced inside :func:`persistent_tiles`.

        The choice is made in Python while the kernel is traced, so a kernel compiled
        elsewhere is FA4's own."""

        @staticmethod
        def get_grid_shape(params, *, loc=None, ip=None):
            grid = stock.get_grid_shape(params, loc=loc, ip=ip)
            if not _persistent_trace(params):
                return grid
            sm_count = cutlass.utils.HardwareInfo().get_device_multiprocessor_count()
            return (cutlass.min(grid[0], sm_count), Int32(1), Int32(1))

        @staticmethod
        @cute.jit
        def create(params, clc=None, *, loc=None, ip=None):
            if cutlass.const_expr(not _persistent_trace(params)):
                return stock.create(params, clc, loc=loc, ip=ip)
            tile_idx, split_idx, _ = cute.arch.block_idx()
            return PersistentVarlenScheduler(params, tile_idx, split_idx, loc=loc, ip=ip)

        def advance_to_next_work(self, *, loc=None, ip=None):
            if not _persistent_trace(self.params):
                return super().advance_to_next_work(loc=loc, ip=ip)
            if not getattr(_state, "own_o", False):
                # The consumers have stored this tile's O (in Q's shared memory): Q may load.
                # Stepping threads: the producer's TMA load warp, and 128 per 64 query rows.
                cute.arch.barrier(barrier_id=TILE_BARRIER, number_of_threads=32 + 2 * self.params.tile_shape_mn[0])
            # Stride by the grid; numbers past the last tile map to no segment (invalid).
            self._tile_idx += cute.arch.grid_dim()[0]
            if LEAN_ADVANCE:  # FA4 asks get_current_work next: map the tile once, there
                return None
            return self.get_current_work()

    return PersistentVarlenScheduler


def _own_o_storage(stock_storage_cls):
    """FA4's ``_get_shared_storage_cls``, plus a buffer for O after its own fields when traced
    inside :func:`persistent_tiles` (and it fits). The epilogue finds it at
    ``self._vitgraph_own_o`` elements from the start of Q's buffer."""
    import cutlass.cute as cute

    def _get_shared_storage_cls(self):
        storage = stock_storage_cls(self)
        self._vitgraph_own_o = None
        _state.own_o = False
        if not (_active() and OWN_O_SMEM) or self.Q_in_regs:  # Q_in_regs: V already reuses Q's buffer
            return storage
        fields = dict(storage._annotations)  # cute.struct keeps its fields and their byte offsets
        fields["sO"] = cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.sO_layout)], 1024]
        own = cute.struct(type("SharedStorageOwnO", (), {"__annotations__": fields}))
        gap = own._offsets["sO"] - own._offsets["sQ"]
        if own.size_in_bytes() > SM90_SMEM_BYTES or gap % 1024:  # 1024: the swizzle's period
            return storage
        self._vitgraph_own_o = gap // (self.dtype.width // 8)
        _state.own_o = True
        return own

    return _get_shared_storage_cls


def _own_o_epilogue(stock_epilogue):
    """FA4's ``epilogue``, storing O through its own buffer where the storage made one."""
    import cutlass.cute as cute

    def epilogue(self, acc_O, lse, mO, mLSE, sO, *args, **kwargs):
        if getattr(self, "_vitgraph_own_o", None) is not None:  # sO is Q's buffer: step past it
            sO = cute.make_tensor(sO.iterator + self._vitgraph_own_o, sO.layout)
        return stock_epilogue(self, acc_O, lse, mO, mLSE, sO, *args, **kwargs)

    return epilogue


def _persistent_trace(params) -> bool:
    # Only the plain layout this module was measured and tested on: one query head per KV
    # head (TMA loads by one producer warp), no split KV, no cluster, no CLC.
    from flash_attn.cute.tile_scheduler import SchedulingMode

    return (_active() and params.qhead_per_kvhead_packgqa == 1 and not params.is_split_kv
            and params.cluster_shape_m == 1 and params.scheduling_mode == SchedulingMode.STATIC
            and not params.lpt)


def install() -> None:
    """Put the thread-routed scheduler and compile cache in place in FA4 (idempotent)."""
    global _installed
    if _installed:
        return
    with _install_lock:
        if _installed:
            return
        import_quack()  # FA4 imports it: without torch._dynamo
        import flash_attn.cute.flash_fwd_sm90 as fwd_sm90
        from flash_attn.cute.cache_utils import get_jit_cache
        from flash_attn.cute.interface import _flash_attn_fwd

        kernel = fwd_sm90.FlashAttentionForwardSm90
        fwd_sm90.SingleTileVarlenScheduler = _persistent_scheduler_class(fwd_sm90.SingleTileVarlenScheduler)
        kernel._get_shared_storage_cls = _own_o_storage(kernel._get_shared_storage_cls)
        kernel.epilogue = _own_o_epilogue(kernel.epilogue)
        _flash_attn_fwd.compile_cache = _ThreadRoutedCache(_flash_attn_fwd.compile_cache,
                                                           functools.cache(get_jit_cache))
        _installed = True
