"""A CUDA stream no one else holds, for a graph bank's captures (see :mod:`vitgraph.engine.graphs`).

torch.cuda.Stream() hands out a fixed pool of streams again and again, and cuBLAS keeps a
workspace per (handle, stream): a pooled stream may come with the workspace a caller or an
earlier bank left on it, outside the bank's pool. So the bank creates its stream through the
CUDA driver, non-blocking like torch's own (a capture on a blocking stream makes any use of the
legacy stream invalid), and never destroys it: a later stream at the same address would inherit
its workspace. A stream (and, until a process-wide clear, its workspace of about 33 MiB) stays
behind for each bank. Without the driver library, a pooled stream, with a warning.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

logger = logging.getLogger(__name__)

CU_STREAM_NON_BLOCKING = 0x1
CUDA_SUCCESS = 0


@functools.cache
def _driver() -> ctypes.CDLL | None:
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    driver.cuStreamCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
    driver.cuStreamCreate.restype = ctypes.c_int
    driver.cuCtxGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
    driver.cuCtxGetDevice.restype = ctypes.c_int
    driver.cuStreamGetFlags.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint)]
    driver.cuStreamGetFlags.restype = ctypes.c_int
    return driver


def own_stream(device: torch.device) -> torch.cuda.Stream:
    """A new non-blocking stream on ``device`` (a CUDA device) that no other code holds."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    driver = _driver()
    if driver is not None:
        with torch.cuda.device(index):
            torch.cuda.synchronize(index)  # a runtime call: the device's primary context is this thread's
            current, handle = ctypes.c_int(-1), ctypes.c_void_p()
            if (driver.cuCtxGetDevice(ctypes.byref(current)) == CUDA_SUCCESS and current.value == index
                    and driver.cuStreamCreate(ctypes.byref(handle), CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS
                    and handle.value):
                return torch.cuda.ExternalStream(handle.value, device=index)
    logger.warning("no stream of its own from the CUDA driver on cuda:%d; capturing on one of torch's "
                "pooled streams, whose cuBLAS workspace a process-wide clear could free", index)
    return torch.cuda.Stream(index)
