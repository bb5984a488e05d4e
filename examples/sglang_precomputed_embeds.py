"""Send vitgraph's embeddings to SGLang as precomputed embeddings (offline ``sglang.Engine``).

The item is ``vitgraph.handoff.sglang_request(embeddings, grid_thw)``:
``{"format": "precomputed_embedding", "feature": [N, width], "image_grid_thw": [k, 3]}``, the
form sglang 0.5.23 parses (``entrypoints/engine.py`` ``Engine.generate``: "a dict containing field
`format`: 'precomputed_embedding' and `feature`"; ``multimodal/processors/base_processor.py``
``process_and_combine_mm_data`` takes the tensor by ``dict_item.pop("feature")``). One such dict
per request and modality (``_validate_one_modality``). The prompt carries one ``<|image_pad|>``
per embedding row (SGLang tokenizes the text as given for precomputed items and finds the
rows' span by that token), so the rows and the prompt agree.

Qwen3-VL: vitgraph's rows are ``[main | deepstack...]``, which SGLang's Qwen3-VL splits itself
(``separate_deepstack_embeds`` in ``models/qwen3_vl.py``).

Why the offline Engine: over HTTP (``POST /generate`` with ``image_data``) the item is JSON, and
the tensor would travel as nested lists; in process it stays a tensor.

Needs a CUDA device and ``pip install "sglang==0.5.23"``. Not run in vitgraph's CI; written from
SGLang's source, not yet run against a real SGLang (see the hand-off note).

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
    merge = encoder.config.spatial_merge_size
    del encoder
    torch.cuda.empty_cache()

    engine = sglang.Engine(model_path=args.model)
    try:
        for path, (embeddings, grid) in zip(args.images, items):
            item = sglang_request([embeddings], grid, merge_size=merge)  # one image per request
            out = engine.generate(prompt=prompt_for(item["feature"].shape[0]), image_data=[item],
                                  sampling_params={"max_new_tokens": 64, "temperature": 0})
            print(f"{path}: {out['text']}")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
