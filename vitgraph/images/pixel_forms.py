"""The array and tensor forms of images and clips: which shapes and dtypes are taken, and for
each refused one a message that names it and the fix that fits it.

An image: an ``HxWx3`` (RGB) or ``HxWx4`` (RGBA) uint8 array, or a ``3xHxW`` / ``4xHxW`` uint8
tensor; RGBA is composited onto white as an RGBA PIL image is (:func:`vitgraph.images.decode.opaque`).

A clip: a list of frames, or one 4-D uint8 array or tensor, as decoders hand them out: channels
last ``[T, H, W, C]`` (decord, PyAV, ``torchvision.io.read_video``) or first ``[T, C, H, W]``
(torchvision's ``output_format="TCHW"``), ``C`` 3 or 4, told apart as transformers' video
processors tell them (``infer_channel_dimension_format``: dim 1 where dims 1 and 3 both could be).

``images`` and ``videos`` are lists, one output per item: transformers also takes a lone image,
a lone 4-D clip (one video) or a 5-D batch, and vitgraph refuses each, naming the list to pass.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from PIL import Image

CHANNELS = (3, 4)  # RGB, RGBA


def _kind(item) -> str:
    return "tensor" if isinstance(item, torch.Tensor) else "array"


def _dtype_name(item) -> str:
    return str(item.dtype).replace("torch.", "")


def _a(word: str) -> str:
    return f"{'an' if word[0] in 'aeio' else 'a'} {word}"  # "a uint8", "an int8"


def _seen(item) -> str:
    """What an array or tensor is, for a message: ``a float32 array of shape [10, 10, 3]``."""
    return f"{_a(_dtype_name(item))} {_kind(item)} of shape {list(item.shape)}"


def dtype_advice(item) -> str:
    """How to make ``item``'s pixels uint8, by its dtype."""
    dtype, tensor = _dtype_name(item), isinstance(item, torch.Tensor)
    if "float" in dtype:
        return ("for values in [0, 1]: (x * 255).round().clamp(0, 255).to(torch.uint8)" if tensor
                else "for values in [0, 1]: (x * 255).round().clip(0, 255).astype(np.uint8)")
    if dtype == "uint16":
        return ("for 16-bit pixels: (x.to(torch.int32) >> 8).to(torch.uint8)" if tensor
                else "for 16-bit pixels: (x >> 8).astype(np.uint8)")
    if dtype == "bool":
        return "a mask: x.to(torch.uint8) * 255" if tensor else "a mask: x.astype(np.uint8) * 255"
    return "cast pixels of 0-255 to uint8"


def image_shape_advice(item) -> str:
    """The fix for an array or tensor in an image's (or frame's) place whose shape no image has."""
    shape, tensor = tuple(item.shape), isinstance(item, torch.Tensor)
    if len(shape) == 2:
        return "greyscale: x.expand(3, -1, -1)" if tensor else "greyscale: np.stack([x] * 3, axis=2)"
    if len(shape) == 3:
        channels, other = (shape[0], shape[2]) if tensor else (shape[2], shape[0])
        if channels == 1:
            return "greyscale: x.expand(3, -1, -1)" if tensor else "greyscale: np.repeat(x, 3, axis=2)"
        if channels == 2:  # grey and alpha: PIL's LA mode, composited onto white like RGBA
            host = "x.permute(1, 2, 0).cpu().numpy()" if tensor else "x"
            return f"grey and alpha: pass PIL.Image.fromarray({host}) (an LA image, composited onto white)"
        if other in CHANNELS:
            return "channels last: x.permute(2, 0, 1)" if tensor else "channels first: x.transpose(1, 2, 0)"
        return f"no image has {channels} channels"
    if len(shape) == 4:
        return "a 4-D array is a clip or a batch: a clip is one item of videos (videos=[x]), a batch is list(x)"
    if len(shape) == 5:
        return "a batch of clips: videos=list(x)"
    return "an image has 3 dimensions"


def check_image_form(item, name: str) -> None:
    """An array or tensor in an image's (or a frame's) place: shape, dtype, then the rest."""
    tensor = isinstance(item, torch.Tensor)
    form = "3xHxW (RGB) or 4xHxW (RGBA)" if tensor else "HxWx3 (RGB) or HxWx4 (RGBA)"
    if item.ndim != 3 or item.shape[0 if tensor else 2] not in CHANNELS:
        raise ValueError(f"{name} {_kind(item)} must be {form}, got {_seen(item)}: {image_shape_advice(item)}")
    if item.dtype != (torch.uint8 if tensor else np.uint8):
        raise TypeError(f"{name} {_kind(item)} must be uint8 (0-255), got {_seen(item)}: {dtype_advice(item)}")
    if tensor and item.device.type == "meta":
        raise ValueError(f"{name} tensor is on the meta device and holds no data")
    if tensor and item.layout != torch.strided:
        raise ValueError(f"{name} tensor must be dense (strided), got layout {item.layout}")
    h, w = item.shape[1:] if tensor else item.shape[:2]
    if h == 0 or w == 0:
        raise ValueError(f"{name} is empty ({w}x{h})")


def channels_first(clip) -> bool:
    """Whether a 4-D clip is ``[T, C, H, W]``: transformers' rule, dim 1 first where both could be."""
    if clip.shape[1] in CHANNELS:
        return True
    if clip.shape[3] in CHANNELS:
        return False
    raise ValueError(f"a clip {_kind(clip)} must be [T, H, W, C] or [T, C, H, W] with C = 3 (RGB) or 4 (RGBA)")


def _clip_shape_advice(clip) -> str:
    axis = 1 if clip.shape[1] == 1 else 3
    if 1 in (clip.shape[1], clip.shape[3]):
        return (f"greyscale frames: x.repeat_interleave(3, dim={axis})" if isinstance(clip, torch.Tensor)
                else f"greyscale frames: np.repeat(x, 3, axis={axis})")
    return f"neither dim 1 ({clip.shape[1]}) nor dim 3 ({clip.shape[3]}) holds 3 or 4 channels"


def clip_frames(clip, name: str) -> list:
    """A clip's frames: a list or tuple as given, or a 4-D uint8 array or tensor split into its
    frames (views: ``HxWxC`` arrays, ``CxHxW`` tensors, checked as frames later)."""
    if isinstance(clip, (list, tuple)):
        return list(clip)
    forms = "a list of frames or one [T, H, W, C] / [T, C, H, W] uint8 array or tensor"
    if not isinstance(clip, (np.ndarray, torch.Tensor)) or clip.ndim != 4:
        raise TypeError(f"{name} must be {forms}, got {described(clip)}: {_clip_advice(clip)}")
    if clip.dtype != (torch.uint8 if isinstance(clip, torch.Tensor) else np.uint8):
        raise TypeError(f"{name} {_kind(clip)} must be uint8 (0-255), got {_seen(clip)}: {dtype_advice(clip)}")
    try:
        first = channels_first(clip)
    except ValueError as err:
        raise ValueError(f"{name}: {err}, got {_seen(clip)}: {_clip_shape_advice(clip)}") from None
    if isinstance(clip, torch.Tensor):
        return list(clip.unbind(0)) if first else [f.permute(2, 0, 1) for f in clip.unbind(0)]
    return [f.transpose(1, 2, 0) for f in clip] if first else list(clip)


def frame_count(clip) -> int:
    """How many frames a clip holds, from its length or shape alone (1 for what is no clip)."""
    if isinstance(clip, (list, tuple)):
        return len(clip)
    if isinstance(clip, (np.ndarray, torch.Tensor)) and clip.ndim == 4:
        return int(clip.shape[0])
    return 1


def described(item) -> str:
    """What an item is, for a message: an array's dtype and shape, else its type."""
    if isinstance(item, (np.ndarray, torch.Tensor)):
        return _seen(item)
    return _a(type(item).__name__)


def _image_like(item) -> bool:
    """One image or frame in some form (not a list of them)."""
    if isinstance(item, (np.ndarray, torch.Tensor)):
        return item.ndim in (2, 3)
    return isinstance(item, (Image.Image, bytes, bytearray, memoryview, str, os.PathLike))


def _clip_advice(clip) -> str:
    """The fix for a clip that is neither a list of frames nor a 4-D array or tensor."""
    if isinstance(clip, (str, os.PathLike)):
        return "vitgraph decodes no video files: decode the frames (decord, torchvision.io) and pass them"
    if isinstance(clip, (np.ndarray, torch.Tensor)) and clip.ndim == 5:
        return "a batch of clips: each is one item of videos (videos=list(x))"
    return "one frame: a clip of it is [x]" if _image_like(clip) else "a clip is a list of frames or a 4-D array"


def list_advice(items, name: str) -> str:
    """What to pass instead of ``images`` or ``videos`` that is not a list ("" where nothing fits)."""
    ndim = items.ndim if isinstance(items, (np.ndarray, torch.Tensor)) else None
    if ndim == 5:
        return "a batch of clips: videos=list(x)"
    if name == "videos":
        if ndim == 4:  # transformers reads it as one clip; a list keeps one output per clip
            return "one clip: videos=[x]"
        if isinstance(items, (str, os.PathLike)):
            return "vitgraph decodes no video files: decode the frames (decord, torchvision.io) and pass videos=[frames]"
        return "one frame: a clip of it is videos=[[x]]; an image goes in images=[x]" if _image_like(items) else ""
    if ndim == 4:
        return "a batch of images: list(x); a clip: videos=[x]"
    return "wrap a single one in a list" if _image_like(items) else ""
