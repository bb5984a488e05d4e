"""A real vLLM ``ec_consumer`` serving images that vitgraph encoded (CPU, float32, tiny random
Qwen2-VL and Qwen3-VL checkpoints built here: language model, vision tower, processor, tokenizer).

vitgraph encodes the images and writes them as the README says (``vitgraph encode FILES
--encoder-cache DIR --model MODEL``, the ids it prints; ``encode_to_cache`` gives the same); a
vLLM ``LLM`` with ``ECExampleConnector`` as ``ec_consumer`` gets requests that carry only each image's grid and id,
and must generate what a vLLM without the connector generates from the same images through its
own tower (pixels) and from vitgraph's tensor as ``image_embeds``. An entry written with other
rows changes the output (vLLM used the file), and an id with no file fails (vLLM looked there).

Skipped where vLLM is not installed (CI); slow: one vLLM engine per side and family, about a
minute a family on 2 CPU cores. vLLM's Qwen-VL models import transformers' Qwen2-VL image
processor, which needs torchvision importable.
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM (not installed here; CI does not install it)")

from helpers import randomize_  # noqa: E402
from PIL import Image  # noqa: E402

from vitgraph import GraphedVisionEncoder  # noqa: E402
from vitgraph.cli import main as cli_main  # noqa: E402
from vitgraph.handoff import CACHE_FILE, encode_to_cache, write_encoder_cache  # noqa: E402

pytestmark = pytest.mark.slow

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
FIRST_SPECIAL, VOCAB, HIDDEN = 100, 128, 128  # head_dim 64: one that vLLM's CPU attention takes
TOKEN = {s: FIRST_SPECIAL + i for i, s in enumerate(SPECIALS)}
PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>describe the image<|im_end|>\n"
          "<|im_start|>assistant\n")


def tokenizer():
    """A word-level tokenizer of VOCAB ids: words, then Qwen's special tokens at the ids the config names."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "user", "assistant", "system", "describe", "the", "image"]
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(len(words), FIRST_SPECIAL)])}
    vocab.update(TOKEN)
    vocab.update({f"x{i}": i for i in range(FIRST_SPECIAL + len(SPECIALS), VOCAB)})  # every id decodes
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")


def build_checkpoint(folder, family: str):
    """A whole tiny checkpoint in the Hub layout (config.json, model.safetensors,
    preprocessor_config.json, tokenizer files) with random, non-trivial fp32 weights."""
    from transformers import Qwen2VLImageProcessor

    text = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                bos_token_id=TOKEN["<|endoftext|>"], eos_token_id=TOKEN["<|im_end|>"])
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}  # head_dim / 2
    if family == "qwen3_vl":
        from transformers import Qwen3VLConfig as Config
        from transformers import Qwen3VLForConditionalGeneration as Model
        text.update(head_dim=64, rope_parameters=dict(rope, mrope_interleaved=True))
        vision = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=HIDDEN,
                      num_position_embeddings=64, deepstack_visual_indexes=[0, 1])
        patch = 16
    else:
        from transformers import Qwen2VLConfig as Config
        from transformers import Qwen2VLForConditionalGeneration as Model
        text.update(rope_parameters=rope)
        vision = dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=4, hidden_size=HIDDEN)
        patch = 14
    config = Config(text_config=text, vision_config=vision, image_token_id=TOKEN["<|image_pad|>"],
                    video_token_id=TOKEN["<|video_pad|>"], vision_start_token_id=TOKEN["<|vision_start|>"],
                    vision_end_token_id=TOKEN["<|vision_end|>"])
    torch.manual_seed(0)
    randomize_(Model(config).float().eval()).save_pretrained(folder)
    factor = 2 * patch
    Qwen2VLImageProcessor(patch_size=patch, min_pixels=4 * factor ** 2,
                          max_pixels=64 * factor ** 2).save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


PNG = b"\x89PNG"


def image(width: int, height: int, seed: int, kind: str) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, kind)
    return buffer.getvalue()


def run(llm, requests):
    """Greedy tokens, their logprobs and the prompt's logprobs of each request."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1,
                            detokenize=False)
    results = []
    for out in llm.generate(requests, params, use_tqdm=False):
        c = out.outputs[0]
        results.append({"prompt": list(out.prompt_token_ids), "tokens": list(c.token_ids),
                        "logprobs": torch.tensor([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]),
                        "prompt_logprobs": torch.tensor([d[t].logprob for d, t in
                                                         zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])])})
    return results


def shut(llm):
    llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_an_ec_consumer_serves_what_vitgraph_encoded(family, tmp_path, monkeypatch, capsys):
    from vllm import LLM
    from vllm.v1.engine.exceptions import EngineDeadError

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the engine process inherits it
    folder = build_checkpoint(tmp_path / "model", family)
    cache = tmp_path / "ec"
    cache.mkdir()

    # Producer: vitgraph reads the same folder (its vision shards) and writes one entry per image.
    encoder = GraphedVisionEncoder.from_pretrained(folder, device="cpu", dtype=torch.float32)
    factor = encoder.processor.factor
    # Sides that are multiples of the factor are not resized (vLLM's processor resizes with
    # torchvision, vitgraph as transformers' PIL processor); the last image is resized.
    images = [image(3 * factor, 2 * factor, 0, "PNG"), image(5 * factor, 4 * factor, 1, "JPEG"),
              image(100, 70, 2, "PNG")]
    # The README's step: vitgraph encode FILES --encoder-cache DIR --model MODEL, the ids printed.
    files = [tmp_path / f"image{i}{'.png' if blob.startswith(PNG) else '.jpg'}" for i, blob in enumerate(images)]
    for path, blob in zip(files, images):
        path.write_bytes(blob)
    assert cli_main(["encode", *map(str, files), "--encoder-cache", str(cache), "--model", str(folder),
                     "--device", "cpu", "--dtype", "fp32"]) == 0
    ids = capsys.readouterr().out.split()
    (tmp_path / "api").mkdir()
    assert ids == encode_to_cache(encoder, images, tmp_path / "api", model=str(folder))  # the API's ids
    grids = encoder.image_rows(images)[1]
    embeds = encoder.encode_images(images=images)
    assert [e.shape[0] for e in embeds] == (grids.prod(-1) // 4).tolist()
    assert embeds[0].shape[1] == HIDDEN * (3 if family == "qwen3_vl" else 1)  # [main | 2 deepstack]
    controls = {"negated": -embeds[0]}  # the first image's grid with other rows
    if family == "qwen3_vl":
        controls["no-deepstack"] = torch.cat([embeds[0][:, :HIDDEN], torch.zeros_like(embeds[0][:, HIDDEN:])], 1)
    for name, tensor in controls.items():
        write_encoder_cache(cache, name, tensor)
    del encoder

    engine = dict(model=str(folder), dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=4,
                  limit_mm_per_prompt={"image": 1}, seed=0)  # the tower on: Qwen3-VL keeps deepstack only then

    # vLLM without the connector: its own tower on the pixels, and vitgraph's rows as image_embeds.
    rows = embeds + list(controls.values())
    grid_of = list(grids) + [grids[0]] * len(controls)
    llm = LLM(enable_mm_embeds=True, **engine)
    try:
        own = run(llm, [{"prompt": PROMPT, "multi_modal_data": {"image": Image.open(io.BytesIO(b))}}
                        for b in images[:2]])
        given = run(llm, [{"prompt": PROMPT, "multi_modal_data": {"image": {
            "image_embeds": r, "image_grid_thw": g.unsqueeze(0)}}} for r, g in zip(rows, grid_of)])
    finally:
        shut(llm)

    # vLLM as ec_consumer: each request carries the grid and the id, no pixels and no rows.
    ec = {"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer",
          "ec_connector_extra_config": {"shared_storage_path": str(cache)}}
    llm = LLM(ec_transfer_config=ec, **engine)
    try:
        names = ids + list(controls)
        served = run(llm, [{"prompt": PROMPT, "multi_modal_data": {"image": {"image_grid_thw": g.unsqueeze(0)}},
                            "multi_modal_uuids": {"image": [name]}} for name, g in zip(names, grid_of)])

        for name, s, g in zip(names, served, given):  # shown with -s
            print(f"{family} {name[:12]}: served {s['tokens']} embeds {g['tokens']}")
        for s, o in zip(served, own):
            print(f"{family} own tower {o['tokens']}, max |logprob diff| {(s['logprobs'] - o['logprobs']).abs().max():.3g}, "
                  f"prompt {(s['prompt_logprobs'] - o['prompt_logprobs']).abs().max():.3g}")
        for i, (s, g) in enumerate(zip(served, given)):  # the same rows, from the file or the request
            assert s["prompt"] == g["prompt"] and s["prompt"].count(TOKEN["<|image_pad|>"]) == len(rows[i])
            assert s["tokens"] == g["tokens"], names[i]
            assert torch.equal(s["logprobs"], g["logprobs"]) and torch.equal(s["prompt_logprobs"], g["prompt_logprobs"])
        for s, o in zip(served, own):  # vitgraph's tower against vLLM's, both fp32
            assert s["tokens"] == o["tokens"]
            assert torch.allclose(s["logprobs"], o["logprobs"], rtol=0, atol=1e-4)
            assert torch.allclose(s["prompt_logprobs"], o["prompt_logprobs"], rtol=0, atol=1e-4)
        assert len({tuple(s["tokens"]) for s in served[:3]}) == 3  # each image its own tokens
        for s in served[3:]:  # other rows under another id: other logprobs
            assert not torch.allclose(s["prompt_logprobs"], served[0]["prompt_logprobs"], rtol=0, atol=1e-3)

        # An id with no file: vLLM looks for DIR/{id}/encoder_cache.safetensors (making the folder),
        # finds none, schedules its tower on an item with no pixels, and the engine dies.
        with pytest.raises(EngineDeadError):
            run(llm, [{"prompt": PROMPT, "multi_modal_data": {"image": {"image_grid_thw": grids[0].unsqueeze(0)}},
                       "multi_modal_uuids": {"image": ["no-such-id"]}}])
        assert (cache / "no-such-id").is_dir() and not os.listdir(cache / "no-such-id")
        assert all((cache / i / CACHE_FILE).is_file() for i in names)
    finally:
        shut(llm)
