"""FP8 against bf16 graphs, one process per preset: speed and distance from fp32.

    python benchmarks/fp8.py --json benchmarks/results/h100-fp8.json      # the three presets, GPU
    TRITON_INTERPRET=1 python benchmarks/fp8.py --presets tiny --device cpu --cases 1x256 --rounds 1  # a CPU
    python benchmarks/fp8.py --outliers ...   # a few outlier channels in the GEMMs' inputs
    python benchmarks/fp8.py --weights block ...   # a block FP8 checkpoint of the weights: grouped FP8

Per preset, two graph encoders of the same random weights, ``precision="bf16"`` and ``"fp8"``,
timed in strictly alternating blocks after a preheat (``vitgraph.bench.common.alternating_ab``):
the patch counts of 1024, 4096 and 16384 tokens and the standard cases. Per case, the distance
from the fp32 reference (the same weights, the plain forward) of the FP8 graph, of the floor (the
reference with each GEMM's input and weight rounded to e4m3 at FP8's granularity) and of the
bf16 graph. With ``--weights block`` the weights are first written as a block FP8 checkpoint
(the blocks' linears in 128x128 blocks, Qwen's ``-FP8`` form) in a temporary directory, removed
after: the bf16 graph runs it dequantized, the FP8 graph grouped, and the reference and its floor
are that checkpoint dequantized in fp32. Writes ``{"gpu": ..., "cases": [{"model", "case",
"weights", "outliers", "tokens", "bf16_ms", "fp8_ms",
"rel_err_fp8", "rel_err_floor", "rel_err_bf16"}], "footprint": {model: {precision: {"capture_s",
"pool_mib", "weight_mib"}}}}`` with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from vitgraph import GraphedVisionEncoder
from vitgraph.bench.common import PREHEAT_SECONDS, alternating_ab, rel_err, write_json
from vitgraph.bench.latency import CASES
from vitgraph.checkpoints.loading import build_tower
from vitgraph.models import PRESETS, family_of
from vitgraph.models.fp8_floor import reference_and_floor
from vitgraph.ops.fp8 import E4M3, E4M3_MAX, held_bytes

TOKENS = {"1024": [(1, 32, 32)], "4096": [(1, 64, 64)], "16384": [(1, 128, 128)]}


def errors(reference, encoders: dict, grids, device) -> dict:
    """The distance of each encoder's output, and of the floor's, from the fp32 reference."""
    gen = torch.Generator().manual_seed(1)
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), reference.input_width, generator=gen).to(device)
    batch = reference.build_batch(grids).to(device)
    ref, floor = (out.double() for out in reference_and_floor(reference, pixels, batch))
    return {"rel_err_fp8": rel_err(encoders["fp8"].encode(pixels, grids).double(), ref),
            "rel_err_floor": rel_err(floor, ref), "rel_err_bf16": rel_err(encoders["bf16"].encode(pixels, grids).double(), ref)}


def footprints(encoders: dict) -> dict:
    """Per precision: capture seconds, the graph pool and the weights held on the device (FP8: the
    blocks' e4m3 weights and scales; their float weights are released)."""
    out = {}
    for precision, enc in encoders.items():
        stats = enc.stats()
        out[precision] = {"capture_s": stats["capture_seconds"], "pool_mib": stats["pool_bytes"] / 2**20,
                          "weight_mib": held_bytes(enc.tower) / 2**20}
    return out


def add_outlier_channels_(tower, channels=(1, 5, 9, 13), factor: float = 30.0) -> None:
    """A few channels of every block's norms ``factor`` x the rest: outliers in the GEMMs' inputs."""
    with torch.no_grad():
        for block in tower.blocks:
            for norm in (block.norm1, block.norm2):
                norm.weight[list(channels)] *= factor


def quantize_blocks(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` as a block FP8 checkpoint stores it: e4m3 and ``weight_scale_inv``, one
    scale per ``block`` x ``block`` tile (the last ones cropped)."""
    rows, cols = weight.shape
    nb, kb = -(-rows // block), -(-cols // block)
    tiles = torch.nn.functional.pad(weight.float(), (0, kb * block - cols, 0, nb * block - rows))
    tiles = tiles.view(nb, block, kb, block)
    scale = (tiles.abs().amax((1, 3)) / E4M3_MAX).clamp_min(2.0 ** -126)
    q = (tiles / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.view(nb * block, kb * block)[:rows, :cols].contiguous(), scale


def write_block_checkpoint(config, state: dict, directory: Path) -> Path:
    """``state`` (a tower's own names) as a hub-layout block FP8 checkpoint in ``directory``: the
    blocks' linears quantized, the rest as they are."""
    tensors = {}
    for name, tensor in state.items():
        if name.startswith("blocks.") and name.endswith(".weight") and tensor.ndim == 2:
            stem = "visual." + name.removesuffix("weight")
            tensors[stem + "weight"], tensors[stem + "weight_scale_inv"] = quantize_blocks(tensor)
        else:
            tensors["visual." + name] = tensor.contiguous()
    save_file({k: v.cpu() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}
    (directory / "config.json").write_text(json.dumps({
        "model_type": family_of(config).model_types[0], "vision_config": config.transformers_fields(),
        "quantization_config": quantization}))
    return directory


def build_encoders(config, state: dict, device: torch.device, dtype: torch.dtype, block_dir: Path | None):
    """The bf16 and FP8 graph encoders of ``state``, and the fp32 reference tower; from a block
    FP8 checkpoint of it in ``block_dir`` when given (FP8 grouped, the rest dequantized)."""
    # exact_eager_above=None: the 16384-token frame replays from its bucket's graph too.
    options = dict(device=device, dtype=dtype, fuse=True, exact_eager_above=None, progress=False)
    if block_dir is None:
        encoders = {p: GraphedVisionEncoder.from_state_dict(state, config, precision=p, **options)
                    for p in ("bf16", "fp8")}
        return encoders, None
    ckpt = write_block_checkpoint(config, state, block_dir)
    encoders = {p: GraphedVisionEncoder.from_pretrained(ckpt, precision=p, **options) for p in ("bf16", "fp8")}
    reference = GraphedVisionEncoder.from_pretrained(ckpt, device=device, dtype=torch.float32, fuse=False,
                                                     progress=False).tower
    return encoders, reference


def run_preset(preset: str, cases: dict, device: torch.device, rounds: int, iters: int,
               preheat: float, outliers: bool = False, weights: str = "float") -> tuple[list[dict], dict]:
    """The preset's case rows, and its :func:`footprints`."""
    config = PRESETS[preset]
    torch.manual_seed(0)
    reference = build_tower(config, device, torch.float32)
    if outliers:
        add_outlier_channels_(reference)
    state = reference.state_dict()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory(prefix="vitgraph-fp8-") as scratch:
        encoders, block_reference = build_encoders(config, state, device, dtype,
                                                   Path(scratch) if weights == "block" else None)
    reference = block_reference or reference
    memory = footprints(encoders)
    print(f"{preset}: " + "; ".join(f"{p} capture {v['capture_s']:.1f} s, pool {v['pool_mib']:.0f} MiB, weights "
                                    f"{v['weight_mib']:.0f} MiB" for p, v in memory.items()))
    rows = alternating_ab(lambda key, pixels, grids: encoders[key].encode(pixels.to(dtype), grids),
                          ("bf16", "fp8"), cases, reference.input_width, device, rounds, iters, preheat)
    out = []
    for name, bf16_ms, fp8_ms, _ in rows:
        grids = cases[name]
        entry = {"model": preset, "case": name, "weights": weights, "outliers": outliers,
                 "tokens": sum(t * h * w for t, h, w in grids),
                 "bf16_ms": bf16_ms, "fp8_ms": fp8_ms, **errors(reference, encoders, grids, device)}
        print(f"{preset:14} {name:14} {entry['tokens']:6}  bf16 {bf16_ms:8.2f}  fp8 {fp8_ms:8.2f} ms "
              f"({bf16_ms / fp8_ms:.2f}x)  from fp32: fp8 {entry['rel_err_fp8']:.2e}, floor "
              f"{entry['rel_err_floor']:.2e}, bf16 {entry['rel_err_bf16']:.2e}", flush=True)
        out.append(entry)
    return out, memory


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["qwen2-vl-2b", "qwen2.5-vl-7b", "qwen3-vl-8b"],
                        choices=sorted(PRESETS))
    parser.add_argument("--cases", nargs="+", default=list(TOKENS) + list(CASES),
                        choices=list(TOKENS) + list(CASES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--preheat", type=float, default=PREHEAT_SECONDS, help="seconds of calls before each case")
    parser.add_argument("--outliers", action="store_true",
                        help="four channels of every norm 30x the rest (outliers in the GEMMs' inputs)")
    parser.add_argument("--weights", default="float", choices=("float", "block"),
                        help="block: a block FP8 checkpoint of the weights (FP8 runs it grouped)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cases = {name: TOKENS.get(name) or CASES[name] for name in args.cases}
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = {"gpu": gpu, "torch": torch.__version__, "cases": [], "footprint": {}}
    for preset in args.presets:
        rows, result["footprint"][preset] = run_preset(preset, cases, device, args.rounds, args.iters, args.preheat,
                                                       args.outliers, args.weights)
        result["cases"] += rows
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
