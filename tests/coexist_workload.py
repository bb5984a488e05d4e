"""A serving process in miniature: vitgraph's encoders living beside torch.compile and the
caller's own CUDA graphs. Run as a script by ``test_coexist.py``, one fresh process per role.

    python coexist_workload.py ROLE OUT.pt [--calls N]

ROLE ``vitgraph`` makes only vitgraph's calls of the schedule, ``others`` only the others',
``together`` all of them interleaved (the others' captures and compiles land between
vitgraph's calls, and vitgraph's first encoder captures after the others have started).
Every call's output is saved to OUT.pt under its index in the schedule, so the test can
compare each call made together with the same call made alone in a fresh process.
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitgraph import GraphedVisionEncoder, VisionConfig

# The Qwen2-VL-2B block's widths (the GEMM shapes, and so cuBLAS's kernels and workspaces, of
# the real tower) in a few blocks, so that three processes build and capture in seconds.
TOWER = VisionConfig(depth=4, embed_dim=1280, num_heads=16, hidden_size=1536)
WIDTH = 512  # the language-model stand-in's width
GRIDS = [(1, 16, 16), (1, 8, 12), (1, 32, 32), (2, 16, 28), (1, 20, 28), (1, 44, 30), (3, 22, 40),
         (1, 8, 72), (1, 36, 52), (1, 4, 4), (16, 16, 16), (1, 64, 64)]
SEQLENS = [7, 64, 129, 300, 512, 77]


class LanguageModelStandIn(nn.Module):
    """Two pre-norm MLP blocks over ``[tokens, WIDTH]``: GEMMs with and without bias epilogues."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH, bias=False)
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            x = x + self.down(F.gelu(self.up(self.norm(x))))
        return self.head(x)


def encoder(name: str) -> GraphedVisionEncoder:
    """Encoder A or B: different budgets, seeds and GEMM backends."""
    options = dict(device="cuda", dtype=torch.bfloat16, progress=False, max_items=8,
                   # no routing timed at capture: timings would make the plans differ between processes
                   tuning={"routing.single_frames": False, "routing.faster_buckets": False})
    if name == "a":
        return GraphedVisionEncoder.from_config(TOWER, seed=1, budgets=[256, 1024, 4096], **options)
    return GraphedVisionEncoder.from_config(TOWER, seed=2, budgets=[512, 2048], gemm="cublas", **options)


def schedule(calls: int, seed: int = 0) -> list[tuple]:
    """``(kind, argument)`` per call. Kinds: ``encode_a``/``encode_b`` (a grid list),
    ``compiled``/``compiled_ro`` (a sequence length), ``user_graph`` (replay), and the events
    ``capture_user`` (the caller captures its own graph) and ``start_a`` (encoder A is built)."""
    rng = random.Random(seed)
    steps: list[tuple] = [("encode_b", [GRIDS[0]]), ("compiled_ro", SEQLENS[0]), ("capture_user", 0),
                          ("start_a", None)]
    kinds = ["encode_a", "encode_b", "compiled", "compiled_ro", "user_graph"]
    while len(steps) < calls:
        kind = rng.choice(kinds)
        if kind.startswith("encode"):
            steps.append((kind, rng.sample(GRIDS, rng.randint(1, 3))))
        elif kind.startswith("compiled"):
            steps.append((kind, rng.choice(SEQLENS)))
        else:
            steps.append((kind, None))
        if len(steps) in (calls // 3, 2 * calls // 3):
            steps.append(("capture_user", len(steps)))
    return steps


def pixels_for(grids, index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(index)
    tokens = sum(t * h * w for t, h, w in grids)
    return torch.randn(tokens, TOWER.patch_width, generator=gen).to("cuda", torch.bfloat16)


def tokens_for(seqlen: int, index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10_000 + index)
    return torch.randn(seqlen, WIDTH, generator=gen).to("cuda", torch.bfloat16)


class Others:
    """What else the serving process runs: one module compiled twice (default and
    reduce-overhead mode) and the caller's own CUDA graph of it, recaptured from time to time."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = LanguageModelStandIn().cuda().to(torch.bfloat16).eval().requires_grad_(False)
        self.compiled = torch.compile(self.model)
        self.compiled_ro = torch.compile(self.model, mode="reduce-overhead")
        self.static_in = torch.zeros(256, WIDTH, device="cuda", dtype=torch.bfloat16)
        self.graph = None

    def capture_user(self, index: int) -> torch.Tensor:
        self.static_in.copy_(tokens_for(256, index))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            self.model(self.static_in)  # warm-up, as torch.cuda.graph's docs ask
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.inference_mode():
            self.static_out = self.model(self.static_in)
        # Memory the caller allocates after its capture (empty_cache ran at capture's start):
        # a freed workspace of vitgraph's would be handed out here.
        self.scratch = torch.full((64 << 20,), 3.0, device="cuda", dtype=torch.bfloat16)
        self.graph.replay()
        return self.static_out.clone()

    def user_graph(self, index: int) -> torch.Tensor:
        self.static_in.copy_(tokens_for(256, index))
        self.graph.replay()
        if not bool((self.scratch == 3.0).all()):
            raise RuntimeError(f"call {index}: memory the caller owns was overwritten")
        return self.static_out.clone()

    def run(self, kind: str, seqlen: int, index: int) -> torch.Tensor:
        fn = self.compiled if kind == "compiled" else self.compiled_ro
        with torch.inference_mode():
            return fn(tokens_for(seqlen, index)).clone()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=("vitgraph", "others", "together"))
    p.add_argument("out")
    p.add_argument("--calls", type=int, default=320)
    args = p.parse_args()
    mine = args.role in ("vitgraph", "together")
    theirs = args.role in ("others", "together")
    steps = schedule(args.calls)
    results = {}
    enc_a = enc_b = None
    if mine:
        # B from the start (before the others exist), A built once the others have compiled
        # and captured (see schedule): vitgraph capturing in a process that already has other pools.
        enc_b = encoder("b")
    others = Others() if theirs else None
    for index, (kind, arg) in enumerate(steps):
        if kind == "start_a":
            if mine:
                enc_a = encoder("a")
            continue
        if kind.startswith("encode"):
            if mine:
                enc = enc_a if kind == "encode_a" else enc_b
                results[index] = enc.encode(pixels_for(arg, index), arg).clone()
        elif theirs:
            if kind == "capture_user":
                results[index] = others.capture_user(index)
            elif kind == "user_graph":
                results[index] = others.user_graph(index)
            else:
                results[index] = others.run(kind, arg, index)
    torch.cuda.synchronize()
    torch.save({k: v.cpu() for k, v in results.items()}, args.out)
    counts = {}
    for kind, _ in steps:
        counts[kind] = counts.get(kind, 0) + 1
    print(f"{args.role}: {len(results)} calls saved; schedule {counts}")


if __name__ == "__main__":
    main()
