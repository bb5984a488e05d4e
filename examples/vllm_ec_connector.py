"""vitgraph as the encode stage of vLLM (disaggregated): vitgraph writes each image's embeddings
where vLLM's ``ECExampleConnector`` reads them, and a vLLM ``ec_consumer`` serves requests that
carry only the images' grids and ids: no pixels, no embeddings.

Needs a CUDA device and vLLM with ``ECExampleConnector`` (``vllm/distributed/ec_transfer/
ec_connector/example_connector.py``; measured with vLLM 0.32). Both steps may run on different
machines that share ``--cache`` (a local folder or a network file system).

    python examples/vllm_ec_connector.py cat.png --cache /shared/ec      # producer, then consumer

Producer: ``vitgraph.handoff.encode_to_cache`` (or ``vitgraph encode IMAGES --encoder-cache DIR``,
or ``POST /encode?store=1`` of ``vitgraph serve --encoder-cache DIR``) writes
``DIR/{id}/encoder_cache.safetensors`` (key ``ec_cache``), atomically, in the encoder's dtype
(bf16 on CUDA, vLLM's too). Consumer: ``start_load_caches`` loads that file for an id once
``os.path.exists`` finds it; an id with no file stops the whole vLLM engine (an assertion in its
worker, then ``EngineDeadError``), with no fallback, so write first. vLLM uses the request's
``multi_modal_uuids`` entry verbatim as the id when the request carries no other hash factors
(only ``image_grid_thw``, as here; ``mm_processor_kwargs`` would make it hash the id). Each lookup
makes ``DIR/{id}/``, so a missing id leaves an empty folder there.

Run against a real vLLM (0.32, its CPU build, fp32) by ``tests/test_vllm_consumer.py``: tokens and
logprobs equal to passing the same rows as ``image_embeds``, tokens equal to vLLM's own tower.

Qwen3-VL: keep vLLM's tower on (an image limit above 0, as here): with it off vLLM drops
deepstack and refuses vitgraph's ``[main | deepstack]`` rows.
"""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("images", nargs="+", help="image files (PNG, JPEG, ...)")
    parser.add_argument("--model", default="Qwen/Qwen2.5-VL-3B-Instruct", help="a Qwen VL checkpoint")
    parser.add_argument("--cache", required=True, help="the shared directory (it must exist)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("this example needs a CUDA device and vLLM with ECExampleConnector: no CUDA device here")
    try:
        from vllm import LLM, SamplingParams
    except ImportError:
        sys.exit("this example needs a CUDA device and vLLM with ECExampleConnector: vLLM is not installed")
    from vitgraph import GraphedVisionEncoder
    from vitgraph.handoff import encode_to_cache

    # 1. Producer: vitgraph encodes and writes; the ids are item_id(bytes, model, processor) unless given.
    encoder = GraphedVisionEncoder.from_pretrained(args.model, device="cuda")
    ids = encode_to_cache(encoder, args.images, args.cache, model=args.model)
    grids = encoder.image_rows(args.images)[1]  # [k, 3]: the consumer sizes the prompt's placeholders by them
    del encoder
    torch.cuda.empty_cache()

    # 2. Consumer: vLLM loads the embeddings by id and skips its tower for them.
    ec = {"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer",
          "ec_connector_extra_config": {"shared_storage_path": args.cache}}
    llm = LLM(model=args.model, ec_transfer_config=ec, limit_mm_per_prompt={"image": 1})  # tower on (Qwen3-VL)
    prompt = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the image."
              "<|im_end|>\n<|im_start|>assistant\n")
    for path, ident, grid in zip(args.images, ids, grids):
        out = llm.generate({"prompt": prompt,
                            "multi_modal_data": {"image": {"image_grid_thw": grid.unsqueeze(0)}},
                            "multi_modal_uuids": {"image": [ident]}},
                           SamplingParams(max_tokens=64, temperature=0))
        print(f"{path} ({ident[:12]}...): {out[0].outputs[0].text}")


if __name__ == "__main__":
    main(sys.argv[1:])
