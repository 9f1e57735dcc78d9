"""The transformers side of bench/multimodal.py, run in the reference venv (torch CPU, transformers, Pillow).

    multimodal_hf.py make FOLDER    writes the benchmark's random-weight LLaVA (SigLIP-base tower over a
                                    SmolLM2-135M-sized Llama, float32, seed 0) and its preprocessor_config.json
    multimodal_hf.py serve FOLDER   a worker that keeps that model loaded

Worker protocol, one JSON a line: {"image": path of a uint8 HxWx3 .npy, "prompt": [ids, placeholders expanded],
"new_tokens": N} in; {"ttft": s, "last": s, "preprocess": s, "encode": s, "tokens": [...]} out. ttft: from the raw
image to the first new token (transformers' own image processor, PIL backend, then a greedy `generate` with no EOS,
timed by a streamer); last: to the N-th token; preprocess: the image processor's share of ttft; encode: the vision
tower and projector alone on the same pixels, timed after the request. Never imported by day0jax.
"""

import json
import os
import sys
import time

import torch

# The model: LLaVA's SigLIP-base tower (224 pixels, 16-pixel patches: 196 image tokens, every patch kept) over a
# language model shaped as SmolLM2-135M.
TEXT = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, rms_norm_eps=1e-5, hidden_act="silu",
            bos_token_id=1, eos_token_id=2, pad_token_id=2)
VISION = dict(model_type="siglip_vision_model", hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
              num_attention_heads=12, image_size=224, patch_size=16)
IMAGE_TOKEN = 49151  # the last id of the vocabulary: no random text token takes it
LLAVA = dict(text_config=TEXT, vision_config=VISION, vision_feature_layer=-1, vision_feature_select_strategy="full",
             image_token_index=IMAGE_TOKEN, image_seq_length=196, tie_word_embeddings=True)
PROCESSOR = dict(image_processor_type="SiglipImageProcessor", do_resize=True, size={"height": 224, "width": 224},
                 resample=3, do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=[0.5, 0.5, 0.5],
                 image_std=[0.5, 0.5, 0.5])


def make(folder: str) -> None:
    """Writes the random model (seeded) into `folder` through a temporary sibling, so a cut-off run leaves none."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.manual_seed(0)
    config = AutoConfig.for_model("llava", **LLAVA)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    tmp = folder.rstrip("/") + ".tmp"
    model.save_pretrained(tmp)
    with open(os.path.join(tmp, "preprocessor_config.json"), "w") as f:
        json.dump(PROCESSOR, f, indent=1)
    os.replace(tmp, folder)


class Clock:
    """A generate streamer that notes when each new token arrives (the first `put` is the prompt)."""

    def __init__(self):
        self.times, self.prompt_seen = [], False

    def put(self, value):
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self):
        pass


def serve(folder: str) -> None:
    import numpy as np
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    reply = os.fdopen(os.dup(1), "w")  # the protocol owns the real stdout; library output goes to stderr
    os.dup2(2, 1)
    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as day0jax's ignore_eos: no token ends or is masked
    processor = AutoImageProcessor.from_pretrained(folder, backend="pil")
    print(json.dumps({"ready": True, "threads": torch.get_num_threads()}), file=reply, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        image = np.load(cmd["image"])
        ids = torch.tensor([cmd["prompt"]])
        n = cmd["new_tokens"]
        clock = Clock()
        with torch.no_grad():
            t0 = time.perf_counter()
            pixels = processor(image, return_tensors="pt")["pixel_values"]
            t_pre = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                                 max_new_tokens=n, do_sample=False, pad_token_id=TEXT["pad_token_id"],
                                 streamer=clock)
            assert out.shape[1] == ids.shape[1] + n and len(clock.times) == n, (out.shape, len(clock.times))
            t1 = time.perf_counter()
            model.model.get_image_features(pixel_values=pixels)
            encode = time.perf_counter() - t1
        print(json.dumps({"ttft": clock.times[0] - t0, "last": clock.times[-1] - t0, "preprocess": t_pre - t0,
                          "encode": encode, "tokens": out[0, ids.shape[1]:].tolist()}), file=reply, flush=True)


if __name__ == "__main__":
    {"make": make, "serve": serve}[sys.argv[1]](sys.argv[2])
