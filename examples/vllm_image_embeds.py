"""Feed vitgraph's embeddings to vLLM as Qwen2-VL or Qwen2.5-VL ``image_embeds``, with vLLM's
own vision tower switched off (it is never loaded).

Needs a CUDA device and vLLM >= 0.11.1 (``enable_mm_embeds`` first appears there; the
embedding-input API moves between releases: https://docs.vllm.ai/en/stable/features/multimodal_inputs/).

    pip install "vllm>=0.11.1"
    python examples/vllm_image_embeds.py cat.png dog.jpg
    python examples/vllm_image_embeds.py --model Qwen/Qwen2.5-VL-3B-Instruct cat.png

Qwen2-VL and Qwen2.5-VL take vitgraph's rows with vLLM's tower off
(``limit_mm_per_prompt={"image": 0, "video": 0}``). Qwen3-VL does not: see
``vllm_qwen3_image_embeds.py``.

Comparing vitgraph with vLLM's own tower directly: vLLM >= 0.32 normalises pixels inside its
tower and expects raw uint8 rows, which ``vitgraph.preprocess_images(images, normalize=False)`` gives.
"""

from __future__ import annotations

import argparse
import sys

import torch
from PIL import Image, ImageOps

from vitgraph import GraphedVisionEncoder, smart_resize


def grid_thw(paths: list[str], processor) -> torch.Tensor:
    """Each image's ``(t, h, w)`` in patches as vitgraph sizes it (turned upright by its EXIF
    orientation, then resized to the processor's pixel range): vLLM takes it beside the rows."""
    patch, factor = processor.patch_size, processor.patch_size * processor.merge_size
    grids = []
    for path in paths:
        with Image.open(path) as image:
            width, height = ImageOps.exif_transpose(image).size
        h, w = smart_resize(height, width, factor, processor.min_pixels, processor.max_pixels)
        grids.append((1, h // patch, w // patch))
    return torch.tensor(grids)


def needs(missing: str) -> None:
    sys.exit(f"this example needs a CUDA device and vLLM >= 0.11.1 (pip install 'vllm>=0.11.1'): {missing}")


def setup(argv: list[str], doc: str, default_model: str, model_help: str):
    """``(args, LLM, SamplingParams)``: the command line (``doc``: the example's docstring), then
    vLLM, where the machine has what it needs."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("images", nargs="+", help="image files (PNG, JPEG, ...)")
    parser.add_argument("--model", default=default_model, help=model_help)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        needs("no CUDA device here")
    try:
        from vllm import LLM, SamplingParams
    except ImportError:
        needs("vLLM is not installed")
    return args, LLM, SamplingParams


def embed(args) -> tuple[GraphedVisionEncoder, torch.Tensor, torch.Tensor]:
    """vitgraph's rows for the image files, items back to back as vLLM takes them, and their grids."""
    encoder = GraphedVisionEncoder.from_pretrained(args.model, device="cuda")
    per_image = encoder.encode_images(args.images)  # one tensor per file
    grids = grid_thw(args.images, encoder.processor)
    assert [len(e) for e in per_image] == (grids.prod(-1) // 4).tolist()
    return encoder, torch.cat(per_image), grids


def describe(llm, sampling_params, count: int, image_embeds: torch.Tensor, grids: torch.Tensor) -> None:
    """Generate from the embeddings (vLLM's tower never runs on them) and print the text."""
    placeholders = "<|vision_start|><|image_pad|><|vision_end|>" * count
    prompt = f"<|im_start|>user\n{placeholders}Describe the image(s).<|im_end|>\n<|im_start|>assistant\n"
    outputs = llm.generate(
        {"prompt": prompt,
         "multi_modal_data": {"image": {"image_embeds": image_embeds.to("cpu", torch.bfloat16),
                                        "image_grid_thw": grids}}},
        sampling_params(max_tokens=64))
    print(outputs[0].outputs[0].text)


def main(argv: list[str]) -> None:
    args, LLM, SamplingParams = setup(argv, __doc__, "Qwen/Qwen2-VL-2B-Instruct", "a Qwen2-VL or Qwen2.5-VL checkpoint")
    _, image_embeds, grids = embed(args)  # [rows, out_hidden_size]
    llm = LLM(model=args.model, enable_mm_embeds=True, limit_mm_per_prompt={"image": 0, "video": 0})  # tower off
    describe(llm, SamplingParams, len(args.images), image_embeds, grids)


if __name__ == "__main__":
    main(sys.argv[1:])
