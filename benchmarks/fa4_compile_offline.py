"""Compile vitgraph's FlashAttention 4 kernels for Hopper (sm_90a) on a machine without a GPU.

    CUTE_DSL_ARCH=sm_90a python benchmarks/fa4_compile_offline.py 16x256 1x256 1x4096
    CUTE_DSL_KEEP=ptx,cubin CUTE_DSL_DUMP_DIR=/tmp/fa4dump CUTE_DSL_ARCH=sm_90a python benchmarks/fa4_compile_offline.py 16x256

For each packed layout (frames x tokens in a 16-slot bucket of their total), it traces and
compiles the kernel vitgraph's ``attend`` would run on an H200 (132 SMs): the tile
``vitgraph.ops.attention`` picks, and the persistent scheduler of ``vitgraph.fa4_persistent``
where it takes it. Use it to check that a change to those kernels still traces and
compiles before spending GPU time on it; with ``CUTE_DSL_KEEP`` the PTX and cubin land in
``CUTE_DSL_DUMP_DIR`` (``cuobjdump --dump-resource-usage`` on the cubin gives registers
and spills). Nothing runs: FA4 compiles under torch's FakeTensorMode and takes the arch
from its ``_arch`` argument. The kernels are not cached to disk for use elsewhere (FA4's
cache is turned off here). Needs the ``fa4`` extra's packages (flash-attn-4 and the CuTe DSL).
"""

import argparse
import contextlib
import os
import time

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "0")

import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

H, D, SLOTS, SM_COUNT = 16, 80, 16, 132


class _H200Info:
    """What the persistent scheduler asks the driver for, without one."""

    def get_device_multiprocessor_count(self) -> int:
        return SM_COUNT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("layouts", nargs="*", default=["16x256", "4x1024", "1x256", "1x4096"],
                        help="FRAMESxTOKENS, e.g. 16x256 (16 frames of 256 tokens)")
    args = parser.parse_args()

    import cutlass.utils
    from flash_attn.cute.interface import _flash_attn_fwd

    import vitgraph.ops.attention as attention
    from vitgraph import fa4_persistent

    cutlass.utils.HardwareInfo = _H200Info
    attention.arch_and_sm_count = lambda device: (9, SM_COUNT)
    for layout in args.layouts:
        frames, tokens = (int(x) for x in layout.split("x"))
        rows = frames * tokens
        tile, persistent = attention._fa4_kernel(tokens, H, torch.device("cuda"), rows)
        start = time.perf_counter()
        with FakeTensorMode():
            q, k, v = (torch.empty(rows, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))
            cu = torch.empty(SLOTS + 1, dtype=torch.int32, device="cuda")
            with fa4_persistent.persistent_tiles() if persistent else contextlib.nullcontext():
                _flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=tokens, max_seqlen_k=tokens,
                                _arch=90, **attention.fa4_tile_kwargs(tile))
        print(f"{layout:10s} tile {tile or 'FA4 default'}{' persistent' if persistent else ''}: "
              f"compiled in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
