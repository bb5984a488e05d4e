"""vitgraph inside a serving process that compiles its language model, as vLLM does: the
LLM stand-in runs under ``torch.compile(mode="reduce-overhead")`` (CUDA-graph trees of its
own) and takes vitgraph's embeddings in place of image tokens, request after request.

    python examples/serving_process.py                 # needs CUDA; random weights, 2B tower shape
    python examples/serving_process.py --model Qwen/Qwen2-VL-2B-Instruct --requests 50

Each request's embeddings are checked against vitgraph's eager forward of the same input,
so a fault or a wrong answer caused by living beside the compiled model would show.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitgraph import GraphedVisionEncoder


class LanguageModelStandIn(nn.Module):
    """A few pre-norm MLP blocks over ``[tokens, width]``, ending in next-token logits."""

    def __init__(self, width: int, vocab: int = 4096, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                                  nn.Linear(4 * width, width)) for _ in range(depth))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, text_ids: torch.Tensor, image_embeds: torch.Tensor) -> torch.Tensor:
        x = torch.cat([image_embeds, self.embed(text_ids)])  # image tokens first, then the prompt
        for block in self.blocks:
            x = x + block(x)
        return self.head(F.layer_norm(x[-1:], x.shape[-1:]))  # logits of the next token


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint directory or Hub id (default: random weights, Qwen2-VL-2B shape)")
    p.add_argument("--requests", type=int, default=40)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this example needs a CUDA GPU")

    if args.model:
        encoder = GraphedVisionEncoder.from_pretrained(args.model, device="cuda", progress=False)
    else:
        encoder = GraphedVisionEncoder.from_config("qwen2-vl-2b", device="cuda", progress=False)
    reference = GraphedVisionEncoder(encoder.tower, device="cuda", dtype=encoder.dtype, mode="eager")
    llm = LanguageModelStandIn(encoder.tower.output_width).cuda().to(encoder.dtype).eval().requires_grad_(False)
    step = torch.compile(llm, mode="reduce-overhead")

    rng = random.Random(0)
    sides = [8, 12, 16, 20, 24, 32, 36, 44, 52, 64]
    worst = 0.0
    start = time.perf_counter()
    with torch.inference_mode():
        for request in range(args.requests):
            # One to three images of random sizes (patch grids); each new shape makes the
            # compiled model record another CUDA graph, between vitgraph's replays.
            grids = [(1, rng.choice(sides), rng.choice(sides)) for _ in range(rng.randint(1, 3))]
            pixels = torch.randn(sum(t * h * w for t, h, w in grids), encoder.tower.input_width,
                                 device="cuda", dtype=encoder.dtype)
            embeds = encoder.encode(pixels, grids)
            text = torch.randint(0, 4096, (rng.choice([16, 32]),), device="cuda")
            logits = step(text, embeds).clone()
            expected = reference.encode(pixels, grids)
            if not torch.isfinite(logits).all():
                raise SystemExit(f"request {request}: non-finite logits")
            err = ((embeds.float() - expected.float()).norm() / expected.float().norm()).item()
            worst = max(worst, err)
            if err > 3e-2:
                raise SystemExit(f"request {request}: embeddings differ from eager (rel err {err:.2e})")
    torch.cuda.synchronize()
    stats = encoder.stats()
    replays = sum(b["replays"] for b in stats["buckets"].values())
    print(f"{args.requests} requests in {time.perf_counter() - start:.1f} s beside torch.compile(reduce-overhead): "
          f"{replays} graph replays, {sum(stats['eager_fallbacks'].values())} eager steps, "
          f"worst rel err against eager {worst:.1e}")


if __name__ == "__main__":
    main()
