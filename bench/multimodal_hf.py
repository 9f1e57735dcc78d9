"""The transformers side of bench/multimodal.py, run in the reference venv (torch CPU, transformers, Pillow), and the
benchmark's model descriptions (`MODELS`, plain dicts: bench/multimodal.py reads them too, without torch).

    multimodal_hf.py make NAME FOLDER    writes the random-weight model NAME of `MODELS` (float32, seed 0) and its
                                         preprocessor_config.json
    multimodal_hf.py serve NAME FOLDER   a worker that keeps that model loaded

Worker protocol, one JSON a line: {"image": path of a uint8 HxWx3 .npy, "prompt": [ids, placeholders expanded],
"new_tokens": N} in; {"ttft": s, "last": s, "preprocess": s, "encode": s, "tokens": [...]} out. ttft: from the raw
image to the first new token (transformers' own image processor, then a greedy `generate` with no EOS, timed by a
streamer); last: to the N-th token; preprocess: the image processor's share of ttft; encode: the vision tower and
projector alone on the same pixels (`get_image_features`), timed after the request. Never imported by day0jax.

Image processors run on their PIL backend, except Kimi K2.5's, which transformers has only for its torchvision
backend: torchvision does not install beside the reference venv's CPU torch, so that one runs on the plain-torch
rendering of the torchvision functions it calls (tests/ref/plain_torchvision, torch's own kernels).
"""

import json
import os
import sys
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 49152
# Token ids no random text token takes (bench/multimodal.py draws text ids below 49000).
IMAGE_TOKEN, VIDEO_TOKEN, START, END = 49151, 49150, 49148, 49149
# The language models: shaped as SmolLM2-135M (576 wide, 9 query and 3 kv heads, 1536-wide MLP, its vocabulary).
SMOL = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, vocab_size=VOCAB,
            max_position_embeddings=2048, rms_norm_eps=1e-5, hidden_act="silu", bos_token_id=1, eos_token_id=2,
            pad_token_id=2)


@dataclass(frozen=True)
class BenchModel:
    """One row of the benchmark: what transformers builds and how an image's placeholders look.

    family: the model_type transformers builds from `config`; folder: the cache folder's name (the day0jax
    checkpoint; the HF one has "-hf" after it); processor: its preprocessor_config.json; backend: the image
    processor backend transformers runs; merge: processor-grid patches per side of one image token; around: token
    ids before and after each image's placeholders; row_end: the token ending each row of placeholders but the last
    (whose end is the last of `around`), for processors that lay images out row by row (Pixtral); image: (height,
    width) of the random uint8 image; summary: the table's title."""

    family: str
    folder: str
    config: dict
    processor: dict
    summary: str
    backend: str = "pil"
    merge: int = 1
    around: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    row_end: int | None = None
    image: tuple[int, int] = (480, 640)
    pad_token_id: int = field(default=SMOL["pad_token_id"])


MODELS = {
    # LLaVA's SigLIP-base tower (224 pixels, 16-pixel patches: 196 image tokens, every patch kept) over a
    # SmolLM2-135M-shaped Llama (30 layers, tied embeddings).
    "llava": BenchModel(
        "llava", "llava-siglip-smollm2",
        dict(text_config=dict(SMOL, model_type="llama", num_hidden_layers=30, tie_word_embeddings=True,
                              rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
             vision_config=dict(model_type="siglip_vision_model", hidden_size=768, intermediate_size=3072,
                                num_hidden_layers=12, num_attention_heads=12, image_size=224, patch_size=16),
             vision_feature_layer=-1, vision_feature_select_strategy="full", image_token_index=IMAGE_TOKEN,
             image_seq_length=196, tie_word_embeddings=True),
        dict(image_processor_type="SiglipImageProcessor", do_resize=True, size={"height": 224, "width": 224},
             resample=3, do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=[0.5, 0.5, 0.5],
             image_std=[0.5, 0.5, 0.5]),
        "LLaVA (SigLIP-base 224/16, 12 layers, over a 30-layer SmolLM2-135M-shaped Llama)"),
    # Kimi K2.5: MoonViT at its published widths (1152 wide, 16 heads, 4304-wide MLP, 14-pixel patches, 64 x 64
    # position table, 2x2 merge, the 4608-wide projector), 2 of its 27 layers, over a small DeepSeek-V3 (MLA, a
    # dense layer then sigmoid top-4 of 16 experts with a shared one, routed as Kimi K2: one group). The image
    # processor's published values (14-pixel patches, at most 16384 of them, 512 a side): a 480x640 image keeps its
    # size, padded to 28-pixel multiples (36 x 46 patches, 414 tokens).
    "kimi_k25": BenchModel(
        "kimi_k25", "kimi_k25-moonvit-deepseek",
        dict(text_config=dict(SMOL, model_type="deepseek_v3", num_hidden_layers=8, num_key_value_heads=9,
                              moe_intermediate_size=256, n_routed_experts=16, num_experts_per_tok=4,
                              n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                              routed_scaling_factor=2.827, norm_topk_prob=True, q_lora_rank=192, kv_lora_rank=128,
                              qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, tie_word_embeddings=False,
                              rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
             vision_config=dict(model_type="kimi_k25_vision", patch_size=14, pos_emb_height=64, pos_emb_width=64,
                                pos_emb_time=4, num_attention_heads=16, num_hidden_layers=2, hidden_size=1152,
                                intermediate_size=4304, merge_kernel_size=[2, 2]),
             projection_hidden_size=1152, image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
             vision_start_token_id=START, vision_end_token_id=END, tie_word_embeddings=False),
        dict(image_processor_type="Kimi_K25ImageProcessor", patch_size=14, merge_size=2, max_patches=16384,
             size={"max_height": 512, "max_width": 512}, resample=3, image_mean=[0.5, 0.5, 0.5],
             image_std=[0.5, 0.5, 0.5]),
        "Kimi K2.5 (MoonViT 1152 wide, 2 layers, over an 8-layer DeepSeek-V3 MoE 576 wide)",
        backend="torchvision", merge=2, around=((START,), (END,))),
    # Mistral Small 3.1: Pixtral at its published widths (1024 wide, 16 heads, 4096-wide gated SiLU MLP, 14-pixel
    # patches, 2x2 merge, no projector biases), 2 of its 24 layers, over an 8-layer SmolLM2-135M-shaped Mistral.
    # Processor: longest edge 1540, patches of 28 pixels (14 x the merge, as PixtralProcessor hands them over): a
    # 480x640 image is padded up to 504 x 644 (36 x 46 tower patches, 18 rows of 23 tokens and a break).
    "mistral3": BenchModel(
        "mistral3", "mistral3-pixtral-smollm2",
        dict(text_config=dict(SMOL, model_type="mistral", num_hidden_layers=8, head_dim=64, sliding_window=None,
                              tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                                          "rope_theta": 1000000000.0}),
             vision_config=dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=2,
                                num_attention_heads=16, head_dim=64, patch_size=14, image_size=1540,
                                hidden_act="silu"),
             image_token_index=IMAGE_TOKEN, spatial_merge_size=2, vision_feature_layer=-1,
             multimodal_projector_bias=False, projector_hidden_act="gelu", tie_word_embeddings=False),
        dict(image_processor_type="PixtralImageProcessor", patch_size={"height": 28, "width": 28},
             size={"longest_edge": 1540}, resample=3, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
             image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711],
             do_convert_rgb=True),
        "Mistral 3 (Pixtral 1024 wide, 2 layers, over an 8-layer SmolLM2-135M-shaped Mistral)",
        around=((), (END,)), row_end=START),
}


def make(name: str, folder: str) -> None:
    """Writes the random model (seeded) into `folder` through a temporary sibling, so a cut-off run leaves none."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    desc = MODELS[name]
    torch.manual_seed(0)
    config = AutoConfig.for_model(desc.family, **desc.config)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    tmp = folder.rstrip("/") + ".tmp"
    model.save_pretrained(tmp)
    with open(os.path.join(tmp, "preprocessor_config.json"), "w") as f:
        json.dump(desc.processor, f, indent=1)
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


def serve(name: str, folder: str) -> None:
    desc = MODELS[name]
    if desc.backend == "torchvision":  # before transformers is imported, so that it finds the package
        sys.path.insert(0, os.path.join(ROOT, "tests", "ref", "plain_torchvision"))
    import numpy as np
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    reply = os.fdopen(os.dup(1), "w")  # the protocol owns the real stdout; library output goes to stderr
    os.dup2(2, 1)
    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as day0jax's ignore_eos: no token ends or is masked
    processor = AutoImageProcessor.from_pretrained(folder, backend=desc.backend)
    print(json.dumps({"ready": True, "threads": torch.get_num_threads()}), file=reply, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        image = np.load(cmd["image"])
        ids = torch.tensor([cmd["prompt"]])
        n = cmd["new_tokens"]
        clock = Clock()
        with torch.no_grad():
            t0 = time.perf_counter()
            # Every tensor the processor gives (pixels, and the grid or sizes of images of their own size).
            pixels = dict(processor(image, return_tensors="pt"))
            t_pre = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **pixels, max_new_tokens=n,
                                 do_sample=False, pad_token_id=desc.pad_token_id, streamer=clock)
            assert out.shape[1] == ids.shape[1] + n and len(clock.times) == n, (out.shape, len(clock.times))
            t1 = time.perf_counter()
            model.model.get_image_features(**pixels)
            encode = time.perf_counter() - t1
        print(json.dumps({"ttft": clock.times[0] - t0, "last": clock.times[-1] - t0, "preprocess": t_pre - t0,
                          "encode": encode, "tokens": out[0, ids.shape[1]:].tolist()}), file=reply, flush=True)


if __name__ == "__main__":
    {"make": make, "serve": serve}[sys.argv[1]](sys.argv[2], sys.argv[3])
