"""Send vitgraph's embeddings to SGLang as precomputed embeddings (offline ``sglang.Engine``).

The item is ``vitgraph.handoff.sglang_request(embeddings, grid_thw)``: ``{"format":
"processor_output", "precomputed_embeddings": [N, width], "image_grid_thw": [k, 3]}``. In sglang
0.5.23 (``python/sglang/srt/``) ``multimodal/processors/base_processor.py``
``collect_mm_items_from_processor_output`` puts the rows on the item's ``precomputed_embeddings``,
which ``managers/mm_schedule.py`` ``_get_precomputed_embedding`` places as they are: no vision tower
runs. (The ``{"format": "precomputed_embedding", "feature": ...}`` form is not that: its rows go to
the model's ``get_image_feature``, and Qwen2-VL's and Qwen3-VL's run their tower on them.) One such
dict per request and modality (``_validate_one_modality``). The prompt is text: it carries one
``<|image_pad|>`` per embedding row between ``<|vision_start|>`` and ``<|vision_end|>``; SGLang
tokenizes it and finds each image's span by that token, and takes the mrope positions from
``image_grid_thw``.

Qwen3-VL: vitgraph's rows are ``[main | deepstack...]``, which SGLang's Qwen3-VL splits itself
(``separate_deepstack_embeds`` in ``models/qwen3_vl.py``, called from ``managers/mm_utils.py``
``embed_mm_inputs``).

Why the offline Engine: over HTTP (``POST /generate`` with ``image_data``) the item is JSON, and
the tensor would travel as nested lists; in process it stays a tensor.

SGLang's own encoder disaggregation (``srt/disaggregation/encoder/http_server.py``: an encode
server's ``POST /encode`` takes ``req_id``, ``modality``, ``mm_items``, ``num_parts`` and
``part_idx``, runs the model's tower, and moves the embeddings to the prefill scheduler over ZMQ
or Mooncake after ``/scheduler_receive_url``) is not this: vitgraph does not speak that protocol;
precomputed embeddings are its hand-off to SGLang.

Needs a CUDA device and ``pip install "sglang==0.5.23"``. vitgraph's tests do not run this
example. What they run, on a CPU where sglang is installed (tests/test_handoff.py): this item
through SGLang's own request object, Qwen VL processor, scheduler-side inputs and
``embed_mm_inputs``, for tiny Qwen2-VL and Qwen3-VL checkpoints: the rows land exactly at the image
positions and the tower is never called. The engine's model forward and generation are not run.

    python examples/sglang_precomputed_embeds.py cat.png --model Qwen/Qwen2.5-VL-3B-Instruct
"""

from __future__ import annotations

import argparse
import sys

import torch


def prompt_for(rows: int) -> str:
    """A Qwen chat prompt holding one image of ``rows`` embedding rows."""
    return (f"<|im_start|>user\n<|vision_start|>{'<|image_pad|>' * rows}<|vision_end|>Describe the image."
            "<|im_end|>\n<|im_start|>assistant\n")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("images", nargs="+", help="image files (PNG, JPEG, ...)")
    parser.add_argument("--model", default="Qwen/Qwen2.5-VL-3B-Instruct", help="a Qwen VL checkpoint")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("this example needs a CUDA device and sglang 0.5.23: no CUDA device here")
    try:
        import sglang
    except ImportError:
        sys.exit("this example needs a CUDA device and sglang 0.5.23: sglang is not installed")
    from vitgraph import GraphedVisionEncoder
    from vitgraph.handoff import sglang_request

    encoder = GraphedVisionEncoder.from_pretrained(args.model, device="cuda")
    items = [(encoder.encode_images([path])[0], encoder.image_rows([path])[1]) for path in args.images]
    merge = encoder.shape.spatial_merge_size
    del encoder
    torch.cuda.empty_cache()

    engine = sglang.Engine(model_path=args.model)
    try:
        for path, (embeddings, grid) in zip(args.images, items):
            item = sglang_request([embeddings], grid, merge_size=merge)  # one image per request
            out = engine.generate(prompt=prompt_for(item["precomputed_embeddings"].shape[0]), image_data=[item],
                                  sampling_params={"max_new_tokens": 64, "temperature": 0})
            print(f"{path}: {out['text']}")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
