"""Handing embeddings to serving engines: vLLM's encoder-cache (EC) connector and SGLang's
precomputed embeddings.

vLLM's ``ECExampleConnector`` (``vllm/distributed/ec_transfer/ec_connector/example_connector.py``)
reads ``{shared_storage_path}/{id}/encoder_cache.safetensors`` with
``safetensors.torch.load_file(path, device=...)["ec_cache"]`` once ``os.path.exists`` finds the
file (``_found_match_for_mm_data``); :func:`write_encoder_cache` writes that file, atomically.

Layouts: Qwen2-VL and Qwen2.5-VL hand over their rows as ``encode`` returns them. Qwen3-VL's rows
are ``[main | deepstack...]`` side by side, the layout both engines take, but **vLLM with its
tower off** (``limit_mm_per_prompt={"image": 0, "video": 0}``) turns deepstack off and refuses
that layout (``Error during index put operation``); main rows alone then give other tokens. Keep
vLLM's tower on (an image limit above 0) for Qwen3-VL. SGLang splits the layout itself
(``separate_deepstack_embeds`` in ``models/qwen3_vl.py``) and runs no tower, given the
``processor_output`` item :func:`sglang_request` builds.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from dataclasses import replace
from pathlib import Path

import torch

from .checkpoints.files import save_atomically
from .runtime.validation import check_int

CACHE_FILE = "encoder_cache.safetensors"  # ECExampleConnector._generate_filename_debug
CACHE_KEY = "ec_cache"  # ECExampleConnector.start_load_caches
MARK = "vitgraph"  # safetensors metadata key: an entry vitgraph wrote (only those are replaced or evicted)
TEMP_SUFFIX = ".vitgraph-tmp"  # a write in progress, or one a killed writer left (clean() removes them)
MAX_ID_LENGTH = 200
_ID = re.compile(r"[A-Za-z0-9._-]+")
# The processor settings that change an image's rows (vitgraph.images.preprocess.ProcessorConfig);
# rescale_factor and resample are fixed in vitgraph (preprocess.FIXED_SETTINGS) but named in the
# recipe so that ids stay valid if they ever vary.
ROW_SETTINGS = ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels",
                "image_mean", "image_std", "rescale_factor", "resample")
_FIXED = {"rescale_factor": 1 / 255, "resample": 3}  # 3: bicubic, as PIL numbers it


def item_id(image_bytes: bytes, *, model: str, processor) -> str:
    """The default id of an image: 64 lowercase hex digits, computable by a client beforehand.

    Recipe (version 1)::

        settings = {name: processor[name] for name in ROW_SETTINGS}     # tuples as lists
        header = json.dumps({"model": model, "processor": settings, "recipe": "vitgraph-item-v1"},
                            sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        item_id = sha256(header.encode("ascii") + b"\\n" + image_bytes).hexdigest()

    ``ROW_SETTINGS``: patch_size, temporal_patch_size, merge_size, min_pixels, max_pixels (ints),
    image_mean, image_std (three floats each), rescale_factor (float, 1/255) and resample (int,
    3 = bicubic); floats are written as Python's ``repr`` (the shortest round-trip form, which
    JavaScript's ``JSON.stringify`` also gives). ``model``: the name the checkpoint is served
    under (the Hub id or path given to ``from_pretrained``; ``vitgraph encode`` and ``vitgraph
    serve`` use ``--model`` as given, or ``preset:NAME`` for random weights). ``processor``: a
    :class:`~vitgraph.images.preprocess.ProcessorConfig` (the encoder's ``processor``) or a dict with
    those keys (rescale_factor and resample may be left out). ``image_bytes``: the encoded file.
    """
    if not isinstance(image_bytes, (bytes, bytearray, memoryview)):
        raise TypeError(f"image_bytes must be bytes, got {type(image_bytes).__name__}")
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a non-empty string naming the checkpoint, got {model!r}")
    settings = _row_settings(processor)
    header = json.dumps({"model": model, "processor": settings, "recipe": "vitgraph-item-v1"},
                        sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(header.encode("ascii") + b"\n" + bytes(image_bytes)).hexdigest()


def _row_settings(processor) -> dict:
    raw = processor if isinstance(processor, dict) else {n: getattr(processor, n) for n in ROW_SETTINGS
                                                         if hasattr(processor, n)}
    settings = {}
    for name in ROW_SETTINGS:
        value = raw.get(name, _FIXED.get(name))
        if value is None:
            raise ValueError(f"processor: {name} is missing; item_id needs every setting that changes rows")
        settings[name] = list(value) if isinstance(value, (tuple, list)) else value
    return settings


def check_item_id(value) -> str:
    """``value`` if it names one folder inside the cache directory: 1 to 200 of
    ``[A-Za-z0-9._-]``, not ``.`` or ``..`` (so no separator, NUL or parent reference)."""
    if not isinstance(value, str):
        raise TypeError(f"item_id must be a string, got {type(value).__name__}")
    if not value or len(value) > MAX_ID_LENGTH or value in (".", "..") or not _ID.fullmatch(value):
        raise ValueError(f"item_id {value[:80]!r}: must be 1 to {MAX_ID_LENGTH} characters of [A-Za-z0-9._-], "
                         "not '.' or '..' (it names a folder inside the cache directory)")
    return value


def _check_embeddings(item: str, embeddings) -> torch.Tensor:
    if not isinstance(embeddings, torch.Tensor):
        raise TypeError(f"item {item}: embeddings must be a tensor, got {type(embeddings).__name__}")
    if embeddings.dim() != 2:
        raise ValueError(f"item {item}: embeddings must be 2-D [rows, width], got shape {list(embeddings.shape)}")
    if not embeddings.is_floating_point():
        raise ValueError(f"item {item}: embeddings must be floating point, got {embeddings.dtype}")
    if not torch.isfinite(embeddings).all():
        raise ValueError(f"item {item}: embeddings hold NaN or inf; not written")
    return embeddings.detach().to("cpu").contiguous()


def _is_ours(path: Path) -> bool:
    """Whether ``path`` is a regular file (not a link) holding vitgraph's mark in its header."""
    from safetensors import safe_open

    if path.is_symlink() or not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get(MARK) == "1"
    except Exception:  # not a safetensors file at all: someone else's
        return False


def _item_folder(directory: Path, item: str) -> tuple[Path, bool]:
    """The item's folder (made if missing) and whether this call made it; a link or a file there is refused."""
    if not directory.is_dir():
        raise ValueError(f"encoder cache directory {directory}: is not an existing directory")
    folder = directory / item
    try:
        os.mkdir(folder)
        return folder, True
    except FileExistsError:
        pass
    if folder.is_symlink() or not folder.is_dir():
        raise ValueError(f"item {item}: {folder} exists and is not a plain folder (a link or a file); left untouched")
    return folder, False


def write_encoder_cache(directory, item_id: str, embeddings: torch.Tensor) -> Path:
    """Write one item's ``[rows, width]`` embeddings to ``{directory}/{item_id}/encoder_cache.safetensors``
    under the key ``ec_cache`` (contiguous, on the CPU, in the tensor's dtype: give the dtype
    the engine runs, bf16 for most), the file vLLM's ``ECExampleConnector`` consumer loads.

    Atomic: the tensor goes to a temporary file in the item's folder, is fsynced, then renamed
    over the target, so a consumer sees the whole file or none. The file carries vitgraph's mark
    (safetensors metadata ``{"vitgraph": "1", "item_id": ...}``); a file there without it is
    someone else's and is refused, untouched. ``directory`` must exist; nothing else is written.
    Qwen3-VL into vLLM: keep vLLM's tower on (see the module's docstring)."""
    item = check_item_id(item_id)
    tensor = _check_embeddings(item, embeddings)
    folder, made = _item_folder(Path(directory), item)
    target = folder / CACHE_FILE
    if os.path.lexists(target) and not _is_ours(target):
        raise ValueError(f"item {item}: {target} was not written by vitgraph; left untouched")
    try:
        save_atomically({CACHE_KEY: tensor}, target, {MARK: "1", "item_id": item}, mode=0o644, suffix=TEMP_SUFFIX)
    except BaseException:
        if made:
            os.rmdir(folder)
        raise
    return target


def _entries(directory: Path) -> list[tuple[int, str, int]]:
    """vitgraph's entries in ``directory``: ``(mtime_ns, item_id, bytes)``, oldest first."""
    found = []
    for child in directory.iterdir():
        if child.is_symlink() or not child.is_dir() or not _ID.fullmatch(child.name):
            continue
        path = child / CACHE_FILE
        if _is_ours(path):
            st = path.stat()
            found.append((st.st_mtime_ns, child.name, st.st_size))
    return sorted(found)


def _remove(directory: Path, item: str) -> None:
    """Remove vitgraph's file (and its leftover temporary files) of one item; the folder too
    when that leaves it empty. Anything else in the folder stays."""
    folder = directory / item
    for leftover in folder.glob(f".{CACHE_FILE}.*{TEMP_SUFFIX}"):
        leftover.unlink(missing_ok=True)
    path = folder / CACHE_FILE
    if _is_ours(path):
        path.unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:  # not empty: something that is not vitgraph's stays, and so does its folder
        pass


def clean(directory) -> int:
    """Remove every entry vitgraph wrote in ``directory`` (files carrying its mark, their
    temporary files, and folders that leaves empty); returns how many entries. Foreign files
    and folders stay."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"encoder cache directory {directory}: is not an existing directory")
    entries = _entries(directory)
    for _, item, _ in entries:
        _remove(directory, item)
    for folder in directory.iterdir():  # temporary files a killed writer left beside no entry
        if not folder.is_symlink() and folder.is_dir() and _ID.fullmatch(folder.name) and any(
                folder.glob(f".{CACHE_FILE}.*{TEMP_SUFFIX}")):
            _remove(directory, folder.name)
    return len(entries)


class EncoderCache:
    """A cache directory with a bound: after each :meth:`write`, vitgraph's own entries are
    evicted oldest first (by file time) until at most ``max_items`` entries and ``max_bytes``
    bytes remain; the entries one :meth:`write_all` call writes are never evicted by it (a call
    of more than ``max_items`` items is refused before anything is written). Foreign files and
    folders are never touched. Writers in one process are serialised by a lock; separate processes writing
    one directory should each keep their own bound in mind (eviction there is best effort)."""

    def __init__(self, directory, max_bytes: int | None = None, max_items: int | None = None) -> None:
        check_int("max_bytes", max_bytes, optional=True)
        check_int("max_items", max_items, optional=True)
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ValueError(f"encoder cache directory {self.directory}: is not an existing directory")
        self.max_bytes, self.max_items = max_bytes, max_items
        self._lock = threading.Lock()

    def write(self, item_id: str, embeddings: torch.Tensor) -> Path:
        return self.write_all([(item_id, embeddings)])[0]

    def check_count(self, count: int) -> None:
        """Refuse a call of more items than the bound holds: evicting its own would lose ids it answers."""
        if self.max_items is not None and count > self.max_items:
            raise ValueError(f"{count} items in one call, more than the encoder cache's max_items {self.max_items}")

    def write_all(self, items) -> list[Path]:
        """Write ``(item_id, embeddings)`` pairs, then evict older entries, none of these."""
        items = list(items)
        self.check_count(len(items))
        with self._lock:
            paths = [write_encoder_cache(self.directory, item, tensor) for item, tensor in items]
            if self.max_bytes is not None or self.max_items is not None:
                self._evict(keep={item for item, _ in items})
            return paths

    def _evict(self, keep: set[str]) -> None:
        every = _entries(self.directory)  # one listing: the kept entries' sizes count too
        entries = [e for e in every if e[1] not in keep]
        total = sum(size for _, _, size in every)
        count = len(every)
        for _, item, size in entries:  # oldest first
            if (self.max_items is None or count <= self.max_items) and (self.max_bytes is None or total <= self.max_bytes):
                break
            _remove(self.directory, item)
            total, count = total - size, count - 1

    def clean(self) -> int:
        with self._lock:
            return clean(self.directory)


def _image_bytes(image) -> bytes:
    from .images.decode import read_file

    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, (str, os.PathLike)):
        return read_file(image, f"image {image}")
    raise TypeError(f"images must be encoded bytes or file paths for default ids, got {type(image).__name__}")


def encode_to_cache(encoder, images, directory, ids=None, *, model: str | None = None,
                    cache: EncoderCache | None = None, **encode_images_kwargs) -> list[str]:
    """Encode ``images`` (encoded bytes or file paths) with ``encoder.encode_images`` and write
    each item with :func:`write_encoder_cache` (or ``cache.write_all``, bounded); returns the ids in
    order. ``ids``: one per image, else :func:`item_id` of each image's bytes with ``model`` (the
    name the checkpoint is served under, required then) and the encoder's processor, with the
    ``min_pixels`` / ``max_pixels`` given here folded in. Every id is checked before encoding."""
    images = list(images)
    if ids is None:
        if model is None:
            raise ValueError("model is required for default ids: the name the checkpoint is served under")
        processor = encoder.processor
        bounds = {k: encode_images_kwargs[k] for k in ("min_pixels", "max_pixels") if encode_images_kwargs.get(k)}
        processor = replace(processor, **bounds) if bounds else processor
        blobs = [_image_bytes(image) for image in images]
        ids, images = [item_id(blob, model=model, processor=processor) for blob in blobs], blobs
    else:
        ids = [check_item_id(i) for i in ids]
        if len(ids) != len(images):
            raise ValueError(f"ids: {len(ids)} given for {len(images)} images; give one per image")
        if len(set(ids)) != len(ids):
            raise ValueError("ids: two images share an id; each item needs its own")
    if cache is not None and Path(directory) != cache.directory:
        raise ValueError(f"cache writes to {cache.directory}, not {directory}")
    cache = cache or EncoderCache(directory)  # unbounded: write_encoder_cache per item
    cache.check_count(len(ids))  # before encoding
    cache.write_all(zip(ids, encoder.encode_images(images=images, **encode_images_kwargs)))
    return ids


# SGLang's precomputed embeddings, sglang 0.5.23 (python/sglang/srt/; tests/test_handoff.py runs
# this path of SGLang's own code on a CPU, from Engine.generate's request to the input embeddings):
# - multimodal/processors/base_processor.py, process_and_combine_mm_data: a dict of format
#   "processor_output" goes to collect_mm_items_from_processor_output, which puts its
#   "precomputed_embeddings" on MultimodalDataItem.precomputed_embeddings (modality IMAGE unless a
#   "modality" key says otherwise) and "image_grid_thw" in the item's model_specific_data. A dict of
#   format "precomputed_embedding" instead has dict_item.pop("feature") put on MultimodalDataItem.feature,
#   which the model takes for pixels (below); vitgraph no longer sends that form.
# - managers/mm_schedule.py, get_embedding_and_mask: _get_precomputed_embedding returns the items'
#   precomputed_embeddings and no tower runs; where they are None, _get_chunked_prefill_embedding calls
#   the model's get_image_feature on item.feature: models/qwen2_vl.py runs self.visual on the rows,
#   models/qwen3_vl.py too (_get_visual_feature); models/qwen2_5_vl.py alone hands back rows whose
#   width is not 1176 unchanged.
# - base_processor.py, _validate_one_modality: such a dict is the modality's only item, so every image
#   of a request goes in one dict, rows concatenated in prompt order.
# - A text prompt is enough: with no input_ids in the request or the dict, process_and_combine_mm_data
#   tokenizes the prompt's text, and get_mm_item_offsets finds the images' spans by <|image_pad|>,
#   t * h * w / merge**2 of them per image (the rows of each).
# - multimodal/processors/qwen_vl.py, _process_mm_data_uncached / _get_grid_from_output_or_items: the
#   mrope positions come from the dict's image_grid_thw ([k, 3] of t, h, w).
# - managers/mm_utils.py, embed_mm_inputs: Qwen3-VL's use_deepstack calls models/qwen3_vl.py
#   separate_deepstack_embeds, which takes the first config.hidden_size columns as the main rows and the
#   rest as deepstack rows: vitgraph's [main | deepstack...] layout.
def sglang_request(embeddings, grid_thw, *, merge_size: int = 2) -> dict:
    """SGLang's image item of precomputed embeddings for one request: ``{"format":
    "processor_output", "precomputed_embeddings": [N, width], "image_grid_thw": [k, 3] int64}``;
    pass it as ``image_data=[item]`` (one dict for all the request's images, in prompt order) with a
    prompt holding, per image, ``<|vision_start|>``, one ``<|image_pad|>`` per row, ``<|vision_end|>``.
    SGLang places these rows as they are and runs no vision tower for them, for every Qwen VL family
    (the ``precomputed_embedding`` / ``feature`` form runs Qwen2-VL's and Qwen3-VL's tower on them:
    the source locations are in the comment above).
    ``embeddings``: one ``[rows, width]`` tensor (all images) or a list of them (one per image),
    rows as ``encode`` gives them (Qwen3-VL: main and deepstack side by side). Checked: each
    image's rows are ``t * h * w / merge_size**2``, one width, finite floats; sent on the CPU, contiguous."""
    parts = list(embeddings) if isinstance(embeddings, (list, tuple)) else [embeddings]
    if not parts:
        raise ValueError("embeddings: no item")
    for i, part in enumerate(parts):
        _check_embeddings(f"embeddings[{i}]", part)
    if len({p.shape[1] for p in parts}) != 1 or len({p.dtype for p in parts}) != 1:
        raise ValueError("embeddings: items differ in width or dtype; SGLang takes one [N, width] tensor")
    grid = torch.as_tensor(grid_thw, dtype=torch.int64)
    if grid.dim() == 1:
        grid = grid.unsqueeze(0)
    if grid.dim() != 2 or grid.shape[1] != 3 or grid.shape[0] == 0 or (grid <= 0).any():
        raise ValueError(f"grid_thw must be [k, 3] positive (t, h, w) rows, got {grid.tolist()}")
    if (grid[:, 1:] % merge_size).any():
        raise ValueError(f"grid_thw: h and w must be multiples of merge_size {merge_size}, got {grid.tolist()}")
    rows = (grid.prod(-1) // merge_size ** 2).tolist()
    if len(parts) > 1 and [p.shape[0] for p in parts] != rows:
        raise ValueError(f"embeddings: items have {[p.shape[0] for p in parts]} rows; grid_thw gives {rows}")
    stacked = torch.cat([p.detach().to("cpu") for p in parts]).contiguous()
    if stacked.shape[0] != sum(rows):
        raise ValueError(f"embeddings: {stacked.shape[0]} rows; grid_thw gives {sum(rows)} ({rows})")
    return {"format": "processor_output", "precomputed_embeddings": stacked, "image_grid_thw": grid}
