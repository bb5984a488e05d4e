"""Start-up from a checkpoint on disk: ``from_pretrained`` (weights loaded, graphs captured), timed.

    python benchmarks/startup_checkpoint.py --write /tmp/ckpt   # random Qwen2-VL-2B vision weights, Hub layout, bf16
    python benchmarks/startup_checkpoint.py /tmp/ckpt           # one process: imports, load + build, capture

Run it in fresh processes. For a cold start point ``TRITON_CACHE_DIR``,
``FLASH_ATTENTION_CUTE_DSL_CACHE_DIR`` and ``QUACK_CACHE_DIR`` at new empty directories: the
kernel-compiling workers then start as the checkpoint's config is read, before its weights
load. The weights are read from wherever the OS has them (a file just written is in the page
cache).
"""

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

t0 = time.perf_counter()
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from vitgraph import GraphedVisionEncoder  # noqa: E402
from vitgraph.config import PRESETS  # noqa: E402
from vitgraph.loading import build_tower  # noqa: E402

t1 = time.perf_counter()


def write(directory: Path) -> None:
    config = PRESETS["qwen2-vl-2b"]
    tower = build_tower(config, torch.device("cuda"), torch.bfloat16)
    state = {f"visual.{k}": v.contiguous().cpu() for k, v in tower.state_dict().items()}
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "vision_config": asdict(config)}))
    size = sum(v.numel() * v.element_size() for v in state.values())
    print(f"wrote {len(state)} tensors, {size / 2**30:.2f} GiB, to {directory}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--write", action="store_true", help="write a random-weight checkpoint there instead")
    args = parser.parse_args()
    if args.write:
        write(args.checkpoint)
        return
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    enc = GraphedVisionEncoder.from_pretrained(args.checkpoint, device="cuda", progress=False, capture=False)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    enc.capture()
    t4 = time.perf_counter()
    stats = enc.stats()
    print(f"import {t1 - t0:.1f} s | CUDA init {t2 - t1:.1f} s | load + build {t3 - t2:.1f} s | capture {t4 - t3:.1f} s "
          f"| load + build + capture {t4 - t2:.1f} s | {len(stats['buckets'])} graphs "
          f"| torch._dynamo imported: {'torch._dynamo' in sys.modules}")
    print(f"precompile {stats['precompile']}")


if __name__ == "__main__":
    main()
