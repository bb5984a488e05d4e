"""The package's structure as rules: dependencies point one way (models know no graphs, the
engine knows no model, ops know neither), no import cycles, the engine works for any tower
that keeps its contract, and building and using an encoder patches nothing of anyone's."""

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import vitgraph
from vitgraph.engine.contract import BatchLayout, TowerDims, VisionTower

PACKAGE = Path(vitgraph.__file__).parent
ROOT = PACKAGE.parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The vitgraph modules ``path`` imports anywhere in it: at the top, inside functions and
    under ``if TYPE_CHECKING:`` alike (a cycle through any of them is still a cycle), and the
    modules a lazy ``_EXPORTS`` table names."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets)
                and isinstance(node.value, ast.Dict)):
            found |= {package + v.value if v.value.startswith(".") else v.value for v in node.value.values}
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("vitgraph")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith("vitgraph"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(path, set(mods)) for name, path in mods.items()}


def test_dependencies_point_one_way():
    edges = graph()
    for name, deps in edges.items():
        if name.startswith("vitgraph.engine"):
            assert all(d.startswith("vitgraph.engine") for d in deps), (name, deps)
        if name.startswith("vitgraph.ops"):
            assert all(d.startswith("vitgraph.ops") for d in deps), (name, deps)
        if name.startswith("vitgraph.models"):
            allowed = ("vitgraph.models", "vitgraph.ops", "vitgraph.images.preprocess",
                       "vitgraph.engine.contract", "vitgraph.checkpoints.files")
            assert all(d.startswith(allowed) for d in deps), (name, deps)
            assert not any(d in ("vitgraph.engine.graphs", "vitgraph.engine.planner") for d in deps)
    assert not edges["vitgraph.checkpoints.files"]  # the one module every layer may read files through imports none
    assert edges["vitgraph.models.qwen2_vl"] and edges["vitgraph.engine.graphs"]  # the scan sees imports


ENGINE_ALONE = r"""
import sys
import vitgraph.engine, vitgraph.engine.planner, vitgraph.engine.contract
heavy = sorted(m for m in sys.modules if m.startswith(("vitgraph.models", "vitgraph.ops", "vitgraph.runtime.encoder", "PIL",
                                                       "triton", "transformers", "safetensors", "huggingface_hub")))
print(heavy)
"""


def test_importing_the_engine_loads_no_model_no_pil_no_triton():
    out = subprocess.run([sys.executable, "-c", ENGINE_ALONE], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_no_import_cycles():
    edges = graph()
    state, cycle = {}, []

    def visit(node, path):
        state[node] = "open"
        for dep in sorted(edges[node]):
            if state.get(dep) == "open":
                cycle.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycle, cycle


@dataclass
class PoolBatch(BatchLayout):
    """A toy layout: which segment each row belongs to (-1: padding) and the segment offsets."""

    segment_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int


class MeanPoolTower(torch.nn.Module):
    """Not a ViT: each row is projected, merged in pairs, and each pair gets the mean of its
    segment added; two outputs side by side (as a tower with deepstack features returns).
    It has only what the contract asks."""

    input_width, merge_unit, output_width, output_parts = 12, 2, 2 * 8, 2
    name, gemm_backends, fused = "mean_pool", ("cublas",), False
    shape = TowerDims(embed_dim=8, num_heads=2, head_dim=4, mlp_width=16, patch_width=12, spatial_merge_size=1)
    processor = video_processor = None  # pixel rows only: no images
    tuning_reads = frozenset()  # it runs none of vitgraph's kernels

    def configure(self, attention, fused, tuning, precision="bf16"):
        if precision != "bf16":
            raise ValueError(f"precision={precision!r}: the MeanPoolTower has bf16 GEMMs only")
        self.fused = fused

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(12, 8)
        self.heads = torch.nn.ModuleList(torch.nn.Linear(16, 8) for _ in range(2))

    def build_batch(self, grids, *, num_tokens=None, num_segments=None, max_seqlen=None):
        lengths = [h * w for t, h, w in grids for _ in range(t)]
        real = sum(lengths)
        tokens = real if num_tokens is None else num_tokens
        slots = len(lengths) if num_segments is None else num_segments
        ids = torch.full((tokens,), -1, dtype=torch.int32)
        ids[:real] = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32),
                                             torch.tensor(lengths, dtype=torch.long))
        cu = torch.full((slots + 1,), real, dtype=torch.int32)
        cu[0] = 0
        cu[1:len(lengths) + 1] = torch.tensor(lengths).cumsum(0)
        return PoolBatch(ids, cu, max_seqlen or max(lengths, default=1))

    def forward(self, pixels, batch):
        x = self.proj(pixels)  # [T, 8]
        real = (batch.segment_ids >= 0)[:, None]
        seg = batch.segment_ids.clamp(min=0).long()
        # Segment sums from a prefix sum (deterministic, unlike index_add_'s atomics): [slots, 8].
        prefix = torch.cat([x.new_zeros(1, 8), torch.where(real, x, 0).cumsum(0)])
        cu = batch.cu_seqlens.long()
        sums = prefix[cu[1:]] - prefix[cu[:-1]]
        counts = (cu[1:] - cu[:-1]).clamp(min=1).to(x.dtype)[:, None]
        x = x + (sums / counts)[seg]
        pairs = x.view(-1, 16)
        return torch.cat([head(pairs) for head in self.heads], dim=1)

    def warm_up(self, pixels, batch):
        return self(pixels, batch)


def test_every_family_and_the_toy_keep_the_contract():
    from vitgraph.engine.contract import Precompiled
    from vitgraph.models import FAMILIES, PRESETS

    assert isinstance(MeanPoolTower(), VisionTower) and not isinstance(MeanPoolTower(), Precompiled)
    with torch.device("meta"):
        for family in FAMILIES:
            config = next(c for c in PRESETS.values() if type(c) is family.config)
            assert isinstance(family.tower(config), VisionTower), family.name
    members = {m for m in vars(VisionTower) if not m.startswith("_") or m == "__call__"} | set(VisionTower.__annotations__)
    assert members == {"name", "shape", "processor", "video_processor", "input_width", "output_width", "output_parts", "merge_unit", "gemm_backends",
                       "tuning_reads", "fused", "configure", "build_batch", "__call__", "warm_up"}, members


def test_the_encoder_runs_a_tower_that_is_not_qwen():
    """The encoder needs nothing of a tower but the contract: the public constructor, no
    registry. All but the replay (the CUDA test below replays it)."""
    from vitgraph import GraphedVisionEncoder

    torch.manual_seed(0)
    tower = MeanPoolTower()
    enc = GraphedVisionEncoder(tower, device="cpu", budgets=[64, 128])
    grids = [(1, 4, 6), (2, 2, 4), (1, 6, 2)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 12)
    with torch.inference_mode():
        exact = tower(pixels, tower.build_batch(grids))
    got = enc.encode(pixels, grids)
    assert got.shape == (exact.shape[0], 16) and torch.allclose(got, exact, atol=1e-6)
    main, parts = enc.split(got)
    assert main.shape == (exact.shape[0], 8) and len(parts) == 1  # output_parts = 2
    assert enc.stats()["mode"] == "eager" and tower.fused is False and repr(enc).startswith("GraphedVisionEncoder(mean_pool")
    assert {b.tokens for b in enc.requested_buckets} == {64, 128} and enc.plan(grids).steps  # planned by its shape
    assert torch.equal(enc.submit(pixels, grids).result(), got)  # the coalescing front too
    with pytest.raises(ValueError, match="mean_pool.*processor="):
        enc.encode(torch.zeros(pixels.shape, dtype=torch.uint8), grids)  # uint8 rows need a processor's mean/std
    with pytest.raises(ValueError, match="images and videos need an image processor"):
        enc.encode_images([torch.zeros(3, 28, 28, dtype=torch.uint8)])
    enc.close()


def test_the_public_processors_are_checked_against_the_tower():
    from vitgraph import GraphedVisionEncoder
    from vitgraph.images.preprocess import QWEN2_VL_PROCESSOR, QWEN3_VL_PROCESSOR
    from vitgraph.checkpoints.loading import build_tower
    from vitgraph.models import PRESETS

    tower = build_tower(PRESETS["tiny"], torch.device("cpu"), torch.float32)  # Qwen2-VL: 1176-value rows
    with pytest.raises(ValueError, match=r"processor makes rows of 1536 values.*takes 1176"):
        GraphedVisionEncoder(tower, device="cpu", processor=QWEN3_VL_PROCESSOR)
    with pytest.raises(TypeError, match="processor must be a vitgraph.images.preprocess.ProcessorConfig"):
        GraphedVisionEncoder(tower, device="cpu", processor={"patch_size": 14})
    with pytest.raises(ValueError, match="video_processor needs processor too"):
        GraphedVisionEncoder(MeanPoolTower(), device="cpu", video_processor=QWEN2_VL_PROCESSOR)
    enc = GraphedVisionEncoder(tower, device="cpu", processor=QWEN2_VL_PROCESSOR)
    assert enc.processor is QWEN2_VL_PROCESSOR and enc.shape.patch_width == 1176
    with pytest.raises(AttributeError, match="encoder.shape holds the widths"):
        enc.config  # the runtime reads the contract only; the message says where to look


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_encoder_replays_a_tower_that_is_not_qwen_from_graphs():
    """Graph mode through the public constructor: captured, replayed, equal to eager bitwise."""
    from vitgraph import GraphedVisionEncoder

    torch.manual_seed(0)
    tower = MeanPoolTower()
    enc = GraphedVisionEncoder(tower, device="cuda", dtype=torch.float32, budgets=[64, 128], progress=False)
    assert enc.use_graphs and {b.tokens for b in enc.buckets} == {64, 128}
    grids = [(1, 4, 6), (2, 2, 4), (1, 6, 2)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 12, device="cuda")
    eager = GraphedVisionEncoder(tower, device="cuda", dtype=torch.float32, mode="eager")
    got, exact = enc.encode(pixels, grids), eager.encode(pixels, grids)
    assert enc.stats()["buckets"] and sum(b["replays"] for b in enc.stats()["buckets"].values()) >= 1
    assert torch.allclose(got, exact, atol=1e-5), (got - exact).abs().max()
    big = [(1, 8, 8)] * 3  # 192 rows: two replays of the largest bucket
    pixels = torch.randn(192, 12, device="cuda")
    assert torch.allclose(enc.encode(pixels, big), eager.encode(pixels, big), atol=1e-5)


@pytest.mark.cuda
def test_the_engine_captures_a_tower_that_is_not_qwen():
    from helpers import run_eager
    from vitgraph.engine import GraphBank, make_buckets
    from vitgraph.engine.planner import padded_batch

    torch.manual_seed(0)
    tower = MeanPoolTower().cuda().eval()
    layouts = {b: padded_batch(tower, b) for b in make_buckets([64, 128], 4, tower.merge_unit)}
    bank = GraphBank(tower, layouts, torch.device("cuda"), torch.float32)
    bank.capture(progress=False)
    assert len(bank.buckets) == 2
    grids = [(1, 4, 6), (2, 2, 4), (1, 6, 2)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 12, device="cuda")
    exact = tower(pixels, tower.build_batch(grids).to("cuda"))
    for bucket in bank.buckets:
        bank.load(bucket, pixels, bank.stage(padded_batch(bank.model, bucket, grids)))
        eager = run_eager(bank, bucket)[:exact.shape[0]].clone()
        replayed = bank.replay(bucket)[:exact.shape[0]]
        assert torch.equal(replayed, eager)
        assert torch.allclose(replayed, exact, atol=1e-5), (replayed - exact).abs().max()


PATCH_PROBE = r"""
import json, os, sys, types
import torch
import torch.nn.functional

def public(module):
    return {k: v for k, v in vars(module).items() if not k.startswith("__")}

watched = {"torch": torch, "torch.compiler": torch.compiler, "torch.cuda": torch.cuda,
           "torch.cuda.graphs": torch.cuda.graphs, "torch.nn.functional": torch.nn.functional}
optional = ["flash_attn.cute.interface", "flash_attn.cute.flash_fwd_sm90", "quack.gemm_interface",
            "quack.activation", "cudnn"]
for name in optional:
    try:
        watched[name] = __import__(name, fromlist=["_"])
    except Exception:
        pass
before = {name: public(m) for name, m in watched.items()}
env = dict(os.environ)
acts = set(getattr(watched.get("quack.activation"), "act_fn_map", {}))
fa4_cache = getattr(getattr(watched.get("flash_attn.cute.interface"), "_flash_attn_fwd", None), "compile_cache", None)

from vitgraph import GraphedVisionEncoder
device = sys.argv[1]
enc = GraphedVisionEncoder.from_config("tiny" if device == "cpu" else "qwen2-vl-2b", device=device,
                                       budgets=[256, 1024], progress=False)
grids = [(1, 16, 16), (2, 8, 8)]
enc.encode(torch.randn(sum(t * h * w for t, h, w in grids), 1176, device=device, dtype=enc.dtype), grids)

# A change torch makes itself: state CUDA's lazy init sets (a flag, a count, the generators), or
# torch wrapping its own function as it imports its compiler (torch._dynamo wraps manual_seed).
def torch_own(old, new):
    if not (callable(old) or isinstance(old, types.ModuleType)):
        return True
    return getattr(new, "__wrapped__", None) is old and getattr(new, "__module__", "").startswith("torch")

changed = {name: sorted(k for k in before[name] if before[name][k] is not vars(m).get(k)
                        and not (name.startswith("torch") and torch_own(before[name][k], vars(m).get(k))))
           for name, m in watched.items()}
new_acts = set(getattr(watched.get("quack.activation"), "act_fn_map", {})) - acts
print(json.dumps({"watched": sorted(watched), "changed": {k: v for k, v in changed.items() if v},
                  "env_changed": sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k)),
                  "new_quack_activations": sorted(new_acts),
                  "fa4_cache_same": fa4_cache is getattr(getattr(watched.get("flash_attn.cute.interface"),
                                                              "_flash_attn_fwd", None), "compile_cache", None)}))
"""


def probe_patches(device: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", PATCH_PROBE, device], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_nothing_patched(report: dict) -> None:
    # torch's public functions, FlashAttention 4's and quack's are the same objects afterwards.
    assert report["changed"] == {}, report
    assert report["fa4_cache_same"]
    # quack's activation registry gains only vitgraph's own, uniquely named epilogue.
    assert all(name.startswith("vitgraph_") for name in report["new_quack_activations"])
    # Not one environment variable (FlashAttention 4's disk cache is the process's choice).
    assert report["env_changed"] == [], report


def test_building_and_encoding_patches_nothing_on_a_cpu():
    report = probe_patches("cpu")
    check_nothing_patched(report)


def test_no_module_writes_the_environment_or_another_module():
    """No ``os.environ`` write (item assignment, setdefault, update, pop, putenv) and no
    assignment to an attribute of an imported module anywhere in the package: tuning is data
    the encoder holds, and other libraries keep their own state."""
    writes = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        imported = {a.asname or a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for a in node.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                target = ast.unparse(node.func.value)
                if target == "os.environ" and node.func.attr in ("setdefault", "update", "pop", "clear", "__setitem__"):
                    writes.append((name, node.lineno, ast.unparse(node)))
                if target == "os" and node.func.attr in ("putenv", "unsetenv"):
                    writes.append((name, node.lineno, ast.unparse(node)))
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                for t in getattr(node, "targets", None) or [node.target]:
                    if isinstance(t, ast.Subscript) and ast.unparse(t.value) == "os.environ":
                        writes.append((name, node.lineno, ast.unparse(node)))
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in imported:
                        writes.append((name, node.lineno, ast.unparse(node)))
    assert writes == []


@pytest.mark.cuda
def test_building_and_encoding_patches_nothing_on_a_gpu():
    report = probe_patches("cuda")
    print(f"\n[patches] watched {report['watched']}: {report}")
    check_nothing_patched(report)




def test_small_files_and_functions():
    """No file in the package over 400 lines; no function over 60 (docstrings included)."""
    long_files, long_functions = [], []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        where = str(path.relative_to(ROOT))
        if len(text.splitlines()) > 400:
            long_files.append(where)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long_functions.append((where, node.name, node.end_lineno - node.lineno + 1))
    assert long_files == [] and long_functions == [], (long_files, long_functions)
