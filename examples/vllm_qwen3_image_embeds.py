"""Feed vitgraph's Qwen3-VL embeddings to vLLM as ``image_embeds``. vitgraph returns the layout
vLLM's Qwen3-VL takes: the main embeddings, then each deepstack feature, side by side,
``[N / 4, out_hidden_size * (1 + len(deepstack_visual_indexes))]`` (``encoder.split`` views them apart).

Needs a CUDA device and vLLM >= 0.11.1 (``enable_mm_embeds`` first appears there; the
embedding-input API moves between releases: https://docs.vllm.ai/en/stable/features/multimodal_inputs/).

    pip install "vllm>=0.11.1"
    python examples/vllm_qwen3_image_embeds.py cat.png

Qwen3-VL needs vLLM's own vision tower enabled (an image limit above 0), although it does not
run on embeddings: with it off (``limit_mm_per_prompt={"image": 0, "video": 0}``) vLLM turns
deepstack off and rejects the concatenated layout ("value tensor of shape [70, 384] cannot be
broadcast to indexing result of shape [70, 128]"), and passing the main rows alone silently
drops deepstack. Qwen2-VL and Qwen2.5-VL work with the tower off (``vllm_image_embeds.py``).

Comparing vitgraph with vLLM's own tower directly: vLLM >= 0.32 normalises pixels inside its
tower and expects raw uint8 rows, which ``vitgraph.preprocess_images(images, normalize=False,
processor=encoder.processor)`` gives.
"""

from __future__ import annotations

import argparse
import sys

import torch
from vllm_image_embeds import grid_thw, needs

from vitgraph import GraphedVisionEncoder


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("images", nargs="+", help="image files (PNG, JPEG, ...)")
    parser.add_argument("--model", default="Qwen/Qwen3-VL-8B-Instruct", help="a Qwen3-VL checkpoint")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        needs("no CUDA device here")
    try:
        from vllm import LLM, SamplingParams
    except ImportError:
        needs("vLLM is not installed")

    encoder = GraphedVisionEncoder.from_pretrained(args.model, device="cuda")
    per_image = encoder.encode_images(args.images)  # [rows, 4096 * 4] each for the 8B: main + 3 deepstack
    grids = grid_thw(args.images, encoder.processor)  # 16-pixel patches
    assert [len(e) for e in per_image] == (grids.prod(-1) // 4).tolist()
    image_embeds = torch.cat(per_image)
    main_rows, deepstack = encoder.split(image_embeds)
    print(f"{len(args.images)} image(s): main {list(main_rows.shape)}, {len(deepstack)} deepstack features")

    # The tower stays enabled (a limit above 0): vLLM keeps deepstack on only then.
    llm = LLM(model=args.model, enable_mm_embeds=True, limit_mm_per_prompt={"image": len(args.images)})
    placeholders = "<|vision_start|><|image_pad|><|vision_end|>" * len(args.images)
    prompt = f"<|im_start|>user\n{placeholders}Describe the image(s).<|im_end|>\n<|im_start|>assistant\n"
    outputs = llm.generate(
        {"prompt": prompt,
         "multi_modal_data": {"image": {"image_embeds": image_embeds.to("cpu", torch.bfloat16),
                                        "image_grid_thw": grids}}},
        SamplingParams(max_tokens=64))
    print(outputs[0].outputs[0].text)


if __name__ == "__main__":
    main(sys.argv[1:])
