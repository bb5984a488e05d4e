"""The model arguments the ``vitgraph`` command and the benchmarks share, and the one-line
status they print on stderr while a phase with no count runs (building or loading a tower)."""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from .preset_names import PRESET_NAMES  # not vitgraph.models: that imports torch (seconds)

if TYPE_CHECKING:
    from .runtime.encoder import GraphedVisionEncoder


def add_model_args(parser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESET_NAMES), default=None,
                        help="random weights of this shape (default: qwen2-vl-2b on GPU, tiny on CPU)")
    parser.add_argument("--model", help="a checkpoint directory or Hub repo id (default: none, random weights)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32"),
                        help="default: bf16 on GPU, fp32 on CPU")


def resolve_model_args(args) -> bool:
    """Fill in the device and preset defaults of :func:`add_model_args` in place (the encoder
    resolves ``--dtype`` itself); returns whether the run is on a GPU. A preset name given to
    ``--model`` is refused with the flag it belongs to."""
    import torch

    if args.model in PRESET_NAMES and not Path(args.model).exists():
        raise ValueError(f"--model {args.model}: is a preset name, not a checkpoint; use --preset {args.model} "
                         "for random weights of its shape, or give a checkpoint folder or Hub repo id")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")  # the encoder checks it
    on_gpu = str(args.device).startswith("cuda")
    args.preset = args.preset or ("qwen2-vl-2b" if on_gpu else "tiny")
    return on_gpu


def describe(args) -> str:
    """What ``args`` load, for status and start-up lines."""
    return args.model or f"random weights of the {args.preset} preset"


def make_encoder(args, **options) -> "GraphedVisionEncoder":
    """The encoder ``args`` name, built or loaded under a :func:`status` line; graphs are then
    captured under their own progress bar (unless ``capture=False``)."""
    from .runtime.encoder import GraphedVisionEncoder

    capture = options.pop("capture", True)
    verb = f"loading {args.model}" if args.model else f"building random weights of the {args.preset} preset"
    with status(f"{verb} on {args.device}"):
        if args.model:
            enc = GraphedVisionEncoder.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                                                       capture=False, **options)
        else:
            enc = GraphedVisionEncoder.from_config(args.preset, device=args.device, dtype=args.dtype, seed=0,
                                                   capture=False, **options)
    if capture and enc.bank is not None:
        enc.capture()
    return enc


@contextmanager
def status(message: str, stream=None, after_s: float = 1.0):
    """On a terminal (``stream``, stderr), once the block has run ``after_s``: one line that
    counts its seconds, then the time it took; a failed block erases its line. Elsewhere (a log,
    a pipe) nothing: stderr then holds only errors, so a failure is exactly one line."""
    stream = stream or sys.stderr
    tty = stream.isatty()
    start = time.perf_counter()
    done = threading.Event()
    shown = threading.Event()

    def tick() -> None:
        wait = after_s
        while tty and not done.wait(wait):  # a log gets no line: it could not be taken back
            shown.set()
            stream.write(f"\r{message} ... {time.perf_counter() - start:.0f} s")
            stream.flush()
            wait = 1.0

    thread = threading.Thread(target=tick, name="vitgraph-status", daemon=True)
    thread.start()
    try:
        yield
    except BaseException:
        done.set()
        thread.join()
        if shown.is_set():
            stream.write("\r\033[K")  # erase the line: the error (or "interrupted") says what happened
            stream.flush()
        raise
    done.set()
    thread.join()
    if shown.is_set():
        stream.write(f"\r{message}: done in {time.perf_counter() - start:.1f} s\n")
        stream.flush()
