"""FlashAttention 4's Hopper varlen forward with persistent CTAs, for vitgraph's short tiles.

FA4's Hopper kernel is written as a loop over work tiles, but its varlen scheduler hands each
CTA one (query tile, head, segment) and ends it. On packed buckets of short frames (``16x256``:
512 tiles of 128 rows) much of a CTA's life is then launch, prologue and epilogue. Here the
grid is capped at the SM count and each CTA strides over the same tile numbering. The kernel
keeps O in Q's shared memory, so between two tiles the producer's load warp waits at a named
barrier until the consumer warpgroups have stored O (without it the next Q overwrites O).
The tile math is FA4's own: the output is bitwise the same.

How it plugs in, for the pinned ``flash-attn-4`` release of the ``fa4`` extra: FA4's Hopper
forward picks its varlen scheduler from a module global and keeps compiled kernels in
``_flash_attn_fwd.compile_cache``. :func:`install` replaces both, once, with versions that
behave exactly as FA4's own unless the calling thread is inside :func:`persistent_tiles`;
there the scheduler is the persistent one and kernels live in a cache of their own (on disk
beside FA4's), so a process can hold both kernels of one shape.
"""

from __future__ import annotations

import contextlib
import threading

TILE_BARRIER = 8  # a named barrier FA4's Hopper forward leaves free (it uses 1-6)
CACHE_NAME = "vitgraph-persistent-varlen-v1"  # bump when the scheduler changes

_state = threading.local()  # .active: this thread is inside persistent_tiles
_install_lock = threading.Lock()
_installed = False


def _active() -> bool:
    return getattr(_state, "active", False)


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
    """FA4's compile cache for every caller, except threads inside :func:`persistent_tiles`."""

    def __init__(self, stock, persistent) -> None:
        self.stock, self.persistent = stock, persistent

    def _pick(self):
        return self.persistent if _active() else self.stock

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
            # The consumers have stored this tile's O (in Q's shared memory): Q may load.
            # Stepping threads: the producer's TMA load warp, and 128 per 64 query rows.
            cute.arch.barrier(barrier_id=TILE_BARRIER, number_of_threads=32 + 2 * self.params.tile_shape_mn[0])
            # Stride by the grid; numbers past the last tile map to no segment (invalid).
            self._tile_idx += cute.arch.grid_dim()[0]
            return self.get_current_work()

    return PersistentVarlenScheduler


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
        import flash_attn.cute.flash_fwd_sm90 as fwd_sm90
        from flash_attn.cute.cache_utils import get_jit_cache
        from flash_attn.cute.interface import _flash_attn_fwd

        fwd_sm90.SingleTileVarlenScheduler = _persistent_scheduler_class(fwd_sm90.SingleTileVarlenScheduler)
        _flash_attn_fwd.compile_cache = _ThreadRoutedCache(_flash_attn_fwd.compile_cache,
                                                           get_jit_cache(CACHE_NAME))
        _installed = True
