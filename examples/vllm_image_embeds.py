"""Feed vitgraph's embeddings to vLLM as Qwen2-VL ``image_embeds`` (the vision tower then never runs in vLLM).

Written against vLLM 0.11 (pip install "vllm==0.11.*"); the embedding-input API has moved
between releases, so check https://docs.vllm.ai/en/stable/features/multimodal_inputs/ for yours.

    python examples/vllm_image_embeds.py cat.png
"""

from __future__ import annotations

import sys

import torch
from PIL import Image

from vitgraph import GraphedVisionEncoder, preprocess_images

MODEL = "Qwen/Qwen2-VL-2B-Instruct"


def main(paths: list[str]) -> None:
    try:
        from vllm import LLM, SamplingParams
    except ImportError:
        sys.exit("this example needs vLLM: pip install 'vllm==0.11.*'")

    encoder = GraphedVisionEncoder.from_pretrained(MODEL, device="cuda")
    pixels, grid_thw = preprocess_images([Image.open(p) for p in paths])
    image_embeds = encoder.encode(pixels, grid_thw)  # [sum(t*h*w)/4, 1536], items back to back

    llm = LLM(model=MODEL, limit_mm_per_prompt={"image": len(paths)}, enable_mm_embeds=True)
    placeholders = "<|vision_start|><|image_pad|><|vision_end|>" * len(paths)
    prompt = f"<|im_start|>user\n{placeholders}Describe the image(s).<|im_end|>\n<|im_start|>assistant\n"
    outputs = llm.generate(
        {"prompt": prompt,
         "multi_modal_data": {"image": {"image_embeds": image_embeds.to("cpu", torch.bfloat16),
                                        "image_grid_thw": grid_thw}}},
        SamplingParams(max_tokens=64))
    print(outputs[0].outputs[0].text)


if __name__ == "__main__":
    main(sys.argv[1:] or sys.exit(__doc__))
