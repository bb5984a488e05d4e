"""JPEG planes decoded on the GPU by nvJPEG, through its C API (``ctypes``): the entropy decoding
and the IDCT, each component at its own resolution (``NVJPEG_OUTPUT_UNCHANGED``), so that
:mod:`vitgraph.images.jpeg_color` can upsample and convert them as libjpeg-turbo does (nvJPEG's
own RGB output upsamples chroma otherwise: up to 24 levels from PIL's).

The library is libnvjpeg from the CUDA wheels torch or torchvision install (``nvidia/cu13/lib``,
``nvidia/nvjpeg/lib``, ``torchvision.libs``) or the system's; without it :func:`decoder` is None
and JPEGs are decoded on the host. One handle per device, one decoder state per thread and device
(nvJPEG's rules: states are not shared by threads, and both are bound to the device current when
they were made).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
import sys
import threading

import torch

OUTPUT_UNCHANGED = 0  # nvjpegOutputFormat_t: the components' planes as decoded
MAX_COMPONENT = 4
_PATTERNS = ("nvidia/cu13/lib/libnvjpeg.so*", "nvidia/nvjpeg/lib/libnvjpeg.so*", "torchvision.libs/libnvjpeg*.so*")


class _Image(ctypes.Structure):  # nvjpegImage_t
    _fields_ = [("channel", ctypes.c_void_p * MAX_COMPONENT), ("pitch", ctypes.c_size_t * MAX_COMPONENT)]


def _candidates() -> list[str]:
    found = [path for base in sys.path if os.path.isdir(base) for pattern in _PATTERNS
             for path in sorted(glob.glob(os.path.join(base, pattern)))]
    system = ctypes.util.find_library("nvjpeg")
    return found + ([system] if system else [])


class NvJpeg:
    """``planes(data, device)``: a JPEG's component planes, uint8 tensors on ``device``."""

    def __init__(self, library: ctypes.CDLL):
        self._lib, void_p, c_int_p = library, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)
        library.nvjpegCreateSimple.argtypes = [ctypes.POINTER(void_p)]
        library.nvjpegJpegStateCreate.argtypes = [void_p, ctypes.POINTER(void_p)]
        library.nvjpegGetImageInfo.argtypes = [void_p, ctypes.c_char_p, ctypes.c_size_t, c_int_p, c_int_p,
                                               c_int_p, c_int_p]
        library.nvjpegDecode.argtypes = [void_p, void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int,
                                         ctypes.POINTER(_Image), void_p]
        library.nvjpegJpegStateDestroy.argtypes = [void_p]
        self._handles, self._lock, self._local = {}, threading.Lock(), threading.local()

    def _handle(self, index: int) -> ctypes.c_void_p:
        """The device's handle (made under it, current)."""
        with self._lock:
            if index not in self._handles:
                handle = ctypes.c_void_p()
                if self._lib.nvjpegCreateSimple(ctypes.byref(handle)) != 0:
                    raise OSError("nvjpegCreateSimple failed")
                self._handles[index] = handle
            return self._handles[index]

    def _state(self, index: int) -> ctypes.c_void_p:
        """This thread's state on the device (made under it, current; destroyed with the thread)."""
        states = getattr(self._local, "states", None)
        if states is None:
            states = self._local.states = _ThreadStates(self._lib.nvjpegJpegStateDestroy)
        if index not in states:
            state = ctypes.c_void_p()
            if self._lib.nvjpegJpegStateCreate(self._handle(index), ctypes.byref(state)) != 0:
                raise OSError("nvjpegJpegStateCreate failed")
            states[index] = state
        return states[index]

    def planes(self, data: bytes, device: torch.device, shapes: list[tuple[int, int]]) -> list[torch.Tensor] | None:
        """The planes (Y, or Y, Cb, Cr), each ``[h, w]`` as the JPEG's sampling makes it, decoded on
        ``device``'s current stream and finished; None where nvJPEG refuses the file or reads other
        plane ``shapes`` from its header than the caller's."""
        count, sampling = ctypes.c_int(), ctypes.c_int()
        widths, heights = (ctypes.c_int * MAX_COMPONENT)(), (ctypes.c_int * MAX_COMPONENT)()
        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        with torch.cuda.device(index):
            handle = self._handle(index)
            if self._lib.nvjpegGetImageInfo(handle, data, len(data), ctypes.byref(count), ctypes.byref(sampling),
                                            widths, heights) != 0 or count.value not in (1, 3):
                return None
            if [(heights[i], widths[i]) for i in range(count.value)] != list(shapes):
                return None
            planes = [torch.empty(heights[i], widths[i], dtype=torch.uint8, device=device) for i in range(count.value)]
            image = _Image()
            for i, plane in enumerate(planes):
                image.channel[i], image.pitch[i] = plane.data_ptr(), plane.shape[1]
            stream = torch.cuda.current_stream(device)
            status = self._lib.nvjpegDecode(handle, self._state(index), data, len(data), OUTPUT_UNCHANGED,
                                            ctypes.byref(image), ctypes.c_void_p(stream.cuda_stream))
            stream.synchronize()  # nvJPEG's host stage reads data; the caller's stream may differ
        return planes if status == 0 else None


class _ThreadStates(dict):
    """A thread's decoder states by device index, destroyed when the thread's locals go."""

    def __init__(self, destroy):
        super().__init__()
        self._destroy = destroy  # nvjpegJpegStateDestroy

    def __del__(self):
        try:
            for index, state in self.items():
                with torch.cuda.device(index):
                    self._destroy(state)
        except Exception:  # at interpreter exit CUDA may be gone already; the process frees all then
            pass


@functools.cache
def decoder() -> NvJpeg | None:
    """The process's nvJPEG, or None where no libnvjpeg loads (or there is no CUDA device)."""
    if not torch.cuda.is_available():
        return None
    for path in _candidates():
        try:
            return NvJpeg(ctypes.CDLL(path))
        except (OSError, AttributeError):  # not loadable here, or too old for this API
            continue
    return None
