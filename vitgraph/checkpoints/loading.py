"""Find and load the vision tower's weights from a local directory or the Hugging Face Hub.

Only ``config.json``, the shard index and the shards that hold vision keys are
read or downloaded. Weights are safetensors only (no pickle) and go straight to
the target device and dtype, one tensor at a time; FP8 linears (:mod:`vitgraph.checkpoints.fp8`)
with their scales, dequantized on load.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
from safetensors import SafetensorError, safe_open

from .fp8 import Fp8Reader, attach_checkpoint_scales
from ..models import PRESETS, VISION_PREFIXES, family_for, family_of
from ..models.config_parsing import read_json

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PROCESSOR_FILE = "preprocessor_config.json"
VIDEO_PROCESSOR_FILE = "video_preprocessor_config.json"
PROCESSORS_FILE = "processor_config.json"  # transformers 5 saves each processor nested in it
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


@dataclass
class CheckpointFiles:
    config: Path
    shards: dict[Path, list[str]]  # shard file -> the vision keys (full names) it holds
    processor: Path | None = None  # preprocessor_config.json, where the checkpoint has one
    video_processor: Path | None = None  # video_preprocessor_config.json, where the checkpoint has one
    index: Path | None = None  # model.safetensors.index.json, where the checkpoint has one
    processors: Path | None = None  # processor_config.json, where the checkpoint has one

    def paths(self) -> list[Path]:
        """Every file a load reads."""
        return [p for p in (self.config, self.processor, self.video_processor, self.processors, self.index,
                            *self.shards) if p is not None]


def _vision_name(key: str) -> str | None:
    for prefix in VISION_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return None


def _shards_from_index(index_path: Path) -> dict[str, list[str]]:
    """``shard name -> vision keys`` from a safetensors index, every name checked (see :func:`_shard_name`)."""
    raw = read_json(index_path)
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index_path} is not a valid safetensors index: 'weight_map' must be a JSON object "
                         f"of key -> shard file, got {type(weight_map).__name__}")
    shards: dict[str, list[str]] = {}
    for key, shard in weight_map.items():
        if _vision_name(key) is not None:
            shards.setdefault(_shard_name(index_path, key, shard), []).append(key)
    if not shards:
        raise ValueError(f"{index_path} lists no vision keys (expected names starting with {VISION_PREFIXES})")
    return shards


def _shard_name(index_path: Path, key: str, shard) -> str:
    """A shard name from an index: a relative path that stays inside the checkpoint folder."""
    if not isinstance(shard, str) or not shard:
        raise ValueError(f"{index_path}: weight_map[{key!r}] must be a shard file name, got {shard!r}")
    if "\x00" in shard:  # else os.stat's bare "embedded null byte", naming neither file
        raise ValueError(f"{index_path}: weight_map[{key!r}] = {shard!r} holds a NUL byte; not a file name")
    parts = Path(shard).parts
    if Path(shard).is_absolute() or "\\" in shard or any(part == ".." for part in parts):
        raise ValueError(f"{index_path}: weight_map[{key!r}] = {shard!r} points outside the checkpoint folder")
    return shard


def _inside_checkpoint(path: Path, directory: Path) -> Path:
    """``path`` with symlinks resolved, refused unless it lies in ``directory`` (also resolved),
    or, for a Hugging Face cache snapshot (``<repo>/snapshots/<revision>``), in that repo's
    ``blobs`` folder, where the cache keeps the files its snapshot links point to."""
    root = directory.resolve()
    target = path.resolve()
    allowed = [root]
    if root.parent.name == "snapshots":
        allowed.append(root.parent.parent / "blobs")
    if not any(target == base or base in target.parents for base in allowed):
        raise ValueError(f"{path} resolves to {target}, outside the checkpoint folder {root}")
    return target


def _open(path: Path, device: str = "cpu"):
    """``safe_open``, with a broken file reported as a ValueError that names it."""
    try:
        return safe_open(str(path), framework="pt", device=device)
    except (SafetensorError, OSError, RuntimeError, ValueError) as err:
        raise ValueError(f"{path}: not a readable safetensors file ({err})") from None


def _keys_in_file(path: Path) -> list[str]:
    with _open(path) as f:
        return [k for k in f.keys() if _vision_name(k) is not None]


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _is_file(path: Path) -> bool:
    """Whether ``path`` exists; a ValueError naming it if it does but is no regular file (a
    folder, a FIFO, a dangling link) or cannot be looked at (a name too long, say)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.lexists(path):
            raise ValueError(f"{path} is a symbolic link to nothing") from None
        return False
    except OSError as err:
        raise ValueError(f"{path}: cannot be read ({err.strerror or err})") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{path} is not a regular file")
    return True


def _optional_file(directory: Path, name: str) -> Path | None:
    path = directory / name
    return _inside_checkpoint(path, directory) if _is_file(path) else None


def find_local(directory: Path) -> CheckpointFiles:
    """The files of a local checkpoint. Every path is checked to lie inside ``directory``
    after symlinks are resolved (:func:`_inside_checkpoint`): nothing outside it is opened."""
    config = directory / "config.json"
    if not _is_file(config):
        raise ValueError(f"checkpoint directory {directory} has no config.json")
    config = _inside_checkpoint(config, directory)
    processor, video, processors = (_optional_file(directory, name)
                                    for name in (PROCESSOR_FILE, VIDEO_PROCESSOR_FILE, PROCESSORS_FILE))
    index = directory / INDEX_FILE
    if _is_file(index):
        index = _inside_checkpoint(index, directory)
        shards = {}
        for name, keys in _shards_from_index(index).items():
            shard = directory / name
            if not _is_file(shard):
                raise ValueError(f"{index} names shard {name}, which is missing from {directory}")
            shards[_inside_checkpoint(shard, directory)] = keys
        return CheckpointFiles(config, shards, processor, video, index, processors)
    single = directory / SINGLE_FILE
    if _is_file(single):
        single = _inside_checkpoint(single, directory)
        return CheckpointFiles(config, {single: _keys_in_file(single)}, processor, video, processors=processors)
    raise ValueError(f"checkpoint directory {directory} has neither {INDEX_FILE} nor {SINGLE_FILE}")


def _hub_answers(repo_id: str, revision: str | None, token) -> bool:
    """Whether the Hub answers one request for ``repo_id``'s config.json (no retries: on a
    network error ``hf_hub_download`` retries for ~25 s before it falls back to the cache). A
    repo, revision or config.json the Hub says does not exist is a ValueError naming the model."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    try:
        get_hf_file_metadata(hf_hub_url(repo_id, "config.json", revision=revision), token=token)
    except GatedRepoError:
        raise ValueError(f"model {repo_id}: is gated on the Hugging Face Hub; accept its terms on "
                         f"huggingface.co/{repo_id} and log in (hf auth login)") from None
    except RepositoryNotFoundError:
        raise ValueError(f"model {repo_id}: no such model on the Hugging Face Hub (or it is private: log in with "
                         "hf auth login); give a Hub repo id such as Qwen/Qwen2-VL-2B-Instruct or a "
                         "checkpoint folder") from None
    except RevisionNotFoundError:
        raise ValueError(f"model {repo_id}: the Hub has no revision {revision!r} of it") from None
    except EntryNotFoundError:
        raise ValueError(f"model {repo_id}: has no config.json on the Hugging Face Hub; "
                         "it is not a transformers checkpoint") from None
    except Exception as err:  # a network error or a server's: the cache may still hold the model
        logger.info("%s: the Hugging Face Hub did not answer (%s); using the local cache", repo_id, err)
        return False
    return True


def find_on_hub(repo_id: str, *, revision: str | None, cache_dir: str | Path | None,
                local_files_only: bool, token: str | bool | None) -> CheckpointFiles:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    forbidden = local_files_only or _offline()
    local_files_only = forbidden or not _hub_answers(repo_id, revision, token)

    def fetch(filename: str, missing_ok: bool = False) -> Path | None:
        """The cached or downloaded file; None for a ``missing_ok`` one the Hub lacks (or,
        offline, the cache)."""
        try:
            return Path(hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache_dir,
                                        local_files_only=local_files_only, token=token))
        except LocalEntryNotFoundError:  # a subclass of EntryNotFoundError: not cached, no download
            if missing_ok and local_files_only:
                return None
            why = ("downloads are off (HF_HUB_OFFLINE or local_files_only); allow them"
                   if forbidden else "the Hugging Face Hub cannot be reached; check the network")
            raise ValueError(f"model {repo_id}: {filename} is not in the local Hugging Face cache and {why}, "
                             "or give a checkpoint folder") from None
        except EntryNotFoundError:
            if missing_ok:
                return None
            raise ValueError(f"model {repo_id}: the Hugging Face Hub has no {filename} in it") from None

    config = fetch("config.json")
    # else the family's defaults
    processor, video, processors = (fetch(name, True) for name in (PROCESSOR_FILE, VIDEO_PROCESSOR_FILE,
                                                                    PROCESSORS_FILE))
    index = fetch(INDEX_FILE, True)
    if index is None:
        single = fetch(SINGLE_FILE)
        return CheckpointFiles(config, {single: _keys_in_file(single)}, processor, video, processors=processors)
    shards = {fetch(name): keys for name, keys in _shards_from_index(index).items()}
    logger.info("%s: downloaded %d vision shard(s) of the checkpoint", repo_id, len(shards))
    return CheckpointFiles(config, shards, processor, video, index, processors)


def find_checkpoint(source: str | os.PathLike, *, revision: str | None = None, cache_dir=None,
                    local_files_only: bool = False, token=None) -> CheckpointFiles:
    """A local directory if ``source`` is one, otherwise a Hub repo id."""
    path = Path(source).expanduser()
    text = str(source)
    try:
        exists, is_dir = path.exists(), path.is_dir()
    except OSError as err:  # a name too long, say
        raise ValueError(f"model source {text[:200]!r}: cannot be looked up ({err.strerror or err})") from None
    if is_dir:
        return find_local(path)
    if text in PRESETS and not exists:
        raise ValueError(f"model source {text!r} is a preset name, not a checkpoint; "
                         f"GraphedVisionEncoder.from_config({text!r}) builds random weights of its shape")
    if exists or not _REPO_ID.fullmatch(text):
        raise ValueError(f"model source {text!r} is neither a checkpoint directory nor a Hub repo id")
    return find_on_hub(text, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only, token=token)


def read_config(files: CheckpointFiles):
    """The vision config of a checkpoint whose ``model_type`` has a family (see :mod:`vitgraph.models`)."""
    raw = read_json(files.config)
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type is not None and not isinstance(model_type, str):
        raise ValueError(f"{files.config}: model_type must be a string, got {model_type!r}")
    try:
        return family_for(model_type).config.from_dict(raw)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{files.config}: {err}") from None


def _check_names_and_shapes(config, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Refuse a checkpoint whose vision keys or shapes differ from ``config``'s, before any module is built."""
    expected = family_of(config).expected_shapes(config)
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    wrong = sorted(f"{n}: expected {list(expected[n])}, got {list(shapes[n])}"
                   for n in set(expected) & set(shapes) if expected[n] != shapes[n])
    problems = []
    if missing:
        problems.append(f"missing vision key(s): {missing}")
    if unexpected:
        problems.append(f"unexpected vision key(s): {unexpected}")
    if wrong:
        problems.append(f"wrongly shaped key(s): {wrong}")
    if problems:
        raise ValueError("checkpoint does not match the vision config: " + "; ".join(problems))


def _strip_prefixes(keys) -> dict[str, str]:
    """Map full key -> tower-relative name, refusing a checkpoint that mixes both prefixes."""
    names = {}
    prefixes_seen = set()
    for key in keys:
        for prefix in VISION_PREFIXES:
            if key.startswith(prefix):
                names[key] = key[len(prefix):]
                prefixes_seen.add(prefix)
                break
    if len(prefixes_seen) > 1:
        raise ValueError(f"checkpoint mixes vision key prefixes {sorted(prefixes_seen)}")
    return names


def build_tower(config, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A tower of ``config``'s family with random weights of its shape (for demos and benchmarks)."""
    with torch.device(device):
        tower = family_of(config).tower(config)
    return tower.to(dtype=dtype).eval().requires_grad_(False)


def check_finite(state: Mapping[str, torch.Tensor], where: str) -> None:
    """Refuse weights holding a NaN or an inf (in the dtype they will run in), naming them: one
    flag per tensor on its device, read back once."""
    names = list(state)
    if not names:
        return
    flags = torch.stack([torch.isfinite(state[n]).all() for n in names]).tolist()
    bad = [n for n, ok in zip(names, flags) if not ok]
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise ValueError(f"{where}: non-finite values (NaN or inf) in weight(s) {shown}; pass "
                         f"allow_nonfinite_weights=True to load them anyway")


def load_tower(files: CheckpointFiles, config, device: torch.device, dtype: torch.dtype,
               allow_nonfinite_weights: bool = False) -> torch.nn.Module:
    """The tower of ``files``: float weights cast to ``dtype``, FP8 linears dequantized to it."""
    fp8 = Fp8Reader(files.config)  # refuses a malformed quantization_config before any shard is opened
    all_keys = [k for keys in files.shards.values() for k in keys]
    names = _strip_prefixes(all_keys)
    shapes: dict[str, tuple[int, ...]] = {}
    for shard, keys in files.shards.items():
        with _open(shard) as f:
            present = set(f.keys())
            for key in keys:
                if key not in present:
                    raise ValueError(f"{shard}: has no tensor {key!r}, which the checkpoint's index places there")
                try:
                    view = f.get_slice(key)
                    kind, shape = view.get_dtype(), tuple(view.get_shape())
                except (SafetensorError, RuntimeError, ValueError) as err:
                    raise ValueError(f"{shard}: tensor {key!r} cannot be read ({err})") from None
                if not fp8.sort(shard, key, names[key], kind, shape):  # a scale: fp8 checks its shape
                    shapes[names[key]] = shape
    _check_names_and_shapes(config, shapes)
    fp8.check()

    # safe_open(device=...) places each tensor directly on the target device.
    open_device = "cpu" if device.type == "cpu" else str(device)
    state: dict[str, torch.Tensor] = {}
    for shard, keys in files.shards.items():
        with _open(shard, open_device) as f:
            for key in keys:
                try:
                    tensor = f.get_tensor(key)
                except (SafetensorError, RuntimeError, OSError) as err:  # e.g. a file truncated mid-tensor
                    raise ValueError(f"{shard}: tensor {key!r} cannot be read ({err})") from None
                if not fp8.holds(names[key], tensor):
                    state[names[key]] = tensor.to(dtype)
    quantized = fp8.linears()
    state.update({name: linear.dequantize(dtype) for name, linear in quantized.items()})
    if not allow_nonfinite_weights:
        check_finite(state, f"checkpoint {files.config.parent}")
    with torch.device("meta"):
        tower = family_of(config).tower(config)
        empty = family_of(config).tower(config) if quantized else None
    tower = _assign(tower, state)
    if quantized:  # precision="fp8" takes the checkpoint's e4m3 values back out of the weights
        attach_checkpoint_scales(tower, empty, state, quantized)
    return tower


def tower_from_state_dict(state_dict: Mapping[str, torch.Tensor], config, device: torch.device,
                          dtype: torch.dtype) -> torch.nn.Module:
    """Build from tensors already in memory; keys may carry ``visual.`` / ``model.visual.`` or no prefix.
    Float weights only: an FP8 checkpoint loads through :func:`load_tower`."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of name -> tensor, got {type(state_dict).__name__}")
    for key in state_dict:
        if not isinstance(key, str):
            raise TypeError(f"state_dict keys must be strings, got {key!r}")
    prefixed = _strip_prefixes(state_dict.keys())
    if prefixed:
        state = {name: state_dict[key] for key, name in prefixed.items()}
    else:
        state = dict(state_dict)
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] must be a torch.Tensor, got {type(value).__name__}")
        if value.is_meta or value.layout != torch.strided:  # a sparse weight loaded, then every encode raised
            raise TypeError(f"state_dict[{name!r}] must be a dense tensor with data, got "
                            f"{'a meta tensor' if value.is_meta else f'layout {value.layout}'}")
        if not value.is_floating_point() or value.element_size() < 2:  # FP8 would be cast with no scale
            raise ValueError(f"state_dict[{name!r}] is {value.dtype}; vision weights must be floating point, "
                             "16 bits or more (an FP8 checkpoint loads, dequantized, through from_pretrained)")
    _check_names_and_shapes(config, {n: tuple(t.shape) for n, t in state.items()})
    with torch.device("meta"):
        tower = family_of(config).tower(config)
    return _assign(tower, {n: t.to(device=device, dtype=dtype) for n, t in state.items()})


def _assign(tower: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    tower.load_state_dict(state, strict=True, assign=True)
    tower.reset_buffers()
    return tower.eval().requires_grad_(False)
