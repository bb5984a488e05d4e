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

import sys

from vllm_image_embeds import describe, embed, setup


def main(argv: list[str]) -> None:
    args, LLM, SamplingParams = setup(argv, __doc__, "Qwen/Qwen3-VL-8B-Instruct", "a Qwen3-VL checkpoint")
    encoder, image_embeds, grids = embed(args)  # [rows, 4096 * 4] for the 8B: main + 3 deepstack; 16-px patches
    main_rows, deepstack = encoder.split(image_embeds)
    print(f"{len(args.images)} image(s): main {list(main_rows.shape)}, {len(deepstack)} deepstack features")
    # The tower stays enabled (a limit above 0): vLLM keeps deepstack on only then.
    llm = LLM(model=args.model, enable_mm_embeds=True, limit_mm_per_prompt={"image": len(args.images)})
    describe(llm, SamplingParams, len(args.images), image_embeds, grids)


if __name__ == "__main__":
    main(sys.argv[1:])
