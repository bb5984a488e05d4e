"""Feed vitgraph's Qwen3-VL embeddings to vLLM as ``image_embeds`` (vLLM's vision tower then
never runs). vitgraph returns the layout vLLM's Qwen3-VL takes: the main embeddings, then each
deepstack feature, side by side, ``[N / 4, out_hidden_size * (1 + len(deepstack_visual_indexes))]``.

Written against vLLM's embedding-input API (``enable_mm_embeds``); it moves between releases,
so check https://docs.vllm.ai/en/stable/features/multimodal_inputs/ for yours.

    python examples/vllm_qwen3_image_embeds.py cat.png
"""

from __future__ import annotations

import sys

import torch
from PIL import Image

from vitgraph import GraphedVisionEncoder

MODEL = "Qwen/Qwen3-VL-8B-Instruct"


def main(paths: list[str]) -> None:
    try:
        from vllm import LLM, SamplingParams
    except ImportError:
        sys.exit("this example needs vLLM: pip install vllm")

    encoder = GraphedVisionEncoder.from_pretrained(MODEL, device="cuda")
    images = [Image.open(p) for p in paths]
    from vitgraph.preprocess import preprocess_images

    pixels, grid_thw = preprocess_images(images, processor=encoder.processor)  # 16-pixel patches
    image_embeds = encoder.encode(pixels, grid_thw)  # [N/4, 4096 * 4] for the 8B: main + 3 deepstack
    main_rows, deepstack = encoder.split(image_embeds)
    print(f"{len(paths)} image(s): main {list(main_rows.shape)}, {len(deepstack)} deepstack features")

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
