"""Videos for Qwen3-VL against transformers at float32: the video processor's pixels, grids and prompt placeholders
(transformers' own `Qwen3VLVideoProcessor` on a plain-torch rendering of torchvision, tests/ref/plain_torchvision),
then the tiny qwen3_vl of tests/families.py with a video, and with an image and a video, through `Model.logits` and
`Model.generate` (the engine), against `Qwen3VLForConditionalGeneration` given pixel_values_videos and
video_grid_thw; and the tiny qwen3_5 with an image and a video (logits).

Then `video_url` parts served by a live server through the official `openai` client: an animated GIF as a data URL
gives the tokens of `Model.prepare` + `Model.generate` on the same messages; an mp4 and a GIF over the pixel limit
are refused with a 400 naming the part.

Tolerances: pixels exactly equal (the same float32 operations); logits as the image tests' (tests/parity.py):
worst seen 1.2e-6 relative (float32, CPU; 5.2e-7 with a video alone), qwen3_5 4.9e-6.
"""

import base64
import gc
import io
import json
from types import SimpleNamespace

import jax
import numpy as np
import openai
import pytest
from PIL import Image

import day0jax
from conftest import run_reference
from day0jax.vision.images import ImageError
from day0jax.vision.video import Qwen3VLVideoProcessor, Video, load_video
from launch import serving
from families import BOI, EOI, IMAGE_TOKEN, MULTIMODAL, image_placeholders, parity_engine
from parity import rel_err, tolerance

NEW_TOKENS = 16
VIDEO_TOKEN = 251  # the tiny qwen3_vl config's video_token_id
CASE = MULTIMODAL["qwen3_vl"]
# 4-pixel patches merged 2x2, frame pairs; at most 4 frames' worth of 48 x 48 pixels; 2 to 8 frames sampled.
VIDEO_PROCESSOR = dict(video_processor_type="Qwen3VLVideoProcessor", patch_size=4, temporal_patch_size=2,
                       merge_size=2, size={"shortest_edge": 16 * 16, "longest_edge": 4 * 48 * 48}, min_frames=2,
                       max_frames=8, fps=2, cap_pixels_per_frame=False)


def frames(seed: int, count: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3), dtype=np.uint8)


# (frames, the source fps (video_metadata), sampling keywords): sampled by fps at a given rate (3 of 9 frames, an odd
# count padded to whole frame pairs); at the 24 fps transformers assumes (2 frames); num_frames; no sampling; frames
# resized up past the smallest pixels; and a video of one frame, refused by both.
VIDEOS = [(frames(1, 9, 30, 41), 6, {}), (frames(2, 5, 20, 26), None, {}),
          (frames(3, 7, 24, 24), 10, {"num_frames": 4, "fps": None}),
          (frames(4, 3, 33, 17), 3, {"do_sample_frames": False}), (frames(5, 4, 6, 9), 4, {}),
          (frames(6, 1, 16, 16), 2, {})]


def video(i: int) -> Video:
    array, fps, options = VIDEOS[i]
    return Video(list(array), fps, options)


class Names:
    """A tokenizer's `decode` of the special tokens the expansion writes."""

    NAMES = {IMAGE_TOKEN: "<|image_pad|>", VIDEO_TOKEN: "<|video_pad|>", BOI: "<|vision_start|>",
             EOI: "<|vision_end|>"}

    def decode(self, ids):
        return "".join(self.NAMES[i] for i in ids)


def video_tokens(processed) -> list[int]:
    """A processed video's prompt tokens: per frame pair, a text token standing for its timestamp, then its tokens
    between the vision start and end tokens."""
    _, h, w = processed.grid_thw
    return [t for k in range(len(processed.timestamps)) for t in [60 + k, BOI] + [VIDEO_TOKEN] * (h * w // 4) + [EOI]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """transformers' video processor outputs, and the tiny qwen3_vl's logits and greedy tokens with a video (case 0)
    and with an image then a video (case 1)."""
    from day0jax.vision.processors import image_processor

    root = tmp_path_factory.mktemp("video")
    processor = Qwen3VLVideoProcessor(VIDEO_PROCESSOR)
    cases = []
    for i, (array, fps, options) in enumerate(VIDEOS):
        np.save(root / f"video_{i}.npy", array)
        kwargs = dict(options, video_metadata={"total_num_frames": len(array), "fps": fps,
                                               "frames_indices": list(range(len(array)))})
        cases.append({"config": VIDEO_PROCESSOR, "video": str(root / f"video_{i}.npy"), "kwargs": kwargs})
    image = np.random.default_rng(7).integers(0, 256, (27, 35, 3), dtype=np.uint8)
    first, second = processor.preprocess(video(0)), processor.preprocess(video(1))
    prompts = [[1, 17, 42] + video_tokens(first) + [5, 99, 7],
               [1, 9] + [BOI] + image_placeholders(CASE, image, IMAGE_TOKEN) + [EOI, 33] + video_tokens(second)
               + [120, 14]]
    data = {"tokens_0": np.array(prompts[0], np.int32), "video_pixels_0": first.pixel_values,
            "video_grid_0": np.array([first.grid_thw]), "tokens_1": np.array(prompts[1], np.int32),
            "pixels_1": image_processor(CASE.processor).preprocess(image).pixel_values,
            "grid_1": np.array([image_processor(CASE.processor).preprocess(image).grid_thw]),
            "video_pixels_1": second.pixel_values, "video_grid_1": np.array([second.grid_thw])}
    np.savez(root / "inputs.npz", **data)
    run_reference([{"op": "video_processor_outputs", "cases": cases, "out": str(root / "videos.npz")},
                   {"op": "tiny_hf", "family": CASE.model_type, "config": CASE.config, "seed": 0,
                    "out": str(root / "hf"), "multimodal": True},
                   {"op": "vl_run", "model": str(root / "hf"), "inputs": str(root / "inputs.npz"),
                    "generate": NEW_TOKENS, "out": str(root / "run.npz")},
                   {"op": "tiny_hf", "family": "qwen3_5", "config": MULTIMODAL["qwen3_5"].config, "seed": 0,
                    "out": str(root / "hf_qwen3_5"), "multimodal": True},
                   {"op": "vl_run", "model": str(root / "hf_qwen3_5"), "inputs": str(root / "inputs.npz"),
                    "out": str(root / "run_qwen3_5.npz")}], root)
    for name in ("hf_qwen3_5",):
        (root / name / "preprocessor_config.json").write_text(json.dumps(CASE.processor))
        (root / name / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PROCESSOR))
    (root / "hf" / "preprocessor_config.json").write_text(json.dumps(CASE.processor))
    (root / "hf" / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PROCESSOR))
    write_tokenizer(root / "hf")
    return SimpleNamespace(hf=root / "hf", videos=dict(np.load(root / "videos.npz")), run=np.load(root / "run.npz"),
                           hf_qwen3_5=root / "hf_qwen3_5", run_qwen3_5=np.load(root / "run_qwen3_5.npz"),
                           prompts=prompts, rows=[[video(0)], [image, video(1)]], processor=processor)


@pytest.mark.parametrize("i", range(len(VIDEOS)))
def test_video_pixels_grid_and_placeholder_match_transformers(reference, i):
    ref = reference.videos
    if f"error_{i}" in ref:
        with pytest.raises(ImageError, match="at least 2"):
            reference.processor.preprocess(video(i))
        assert "temporal_factor" in str(ref[f"error_{i}"])
        return
    ours = reference.processor.preprocess(video(i))
    assert ours.grid_thw == tuple(ref[f"video_grid_thw_{i}"].tolist())
    np.testing.assert_array_equal(ours.pixel_values, ref[f"pixel_values_videos_{i}"])
    from day0jax.models.qwen3_vl import Model

    model = SimpleNamespace(config=SimpleNamespace(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
                                                   vision_start_token_id=BOI, vision_end_token_id=EOI,
                                                   vision=SimpleNamespace(spatial_merge_size=2)))
    tokens = ours.grid_thw[0] * ours.grid_thw[1] * ours.grid_thw[2] // 4
    text = Model.expand_image_placeholders(model, "a<|vision_start|><|video_pad|><|vision_end|>b", [tokens], Names(),
                                           grids=[ours.grid_thw], timestamps=[ours.timestamps])
    assert text == "a" + str(ref[f"placeholder_{i}"]) + "b"


# A chat template that shows image and video parts as Qwen3-VL's does.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
            "{% for c in m.content %}{% if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
            "{% elif c.type == 'video' %}<|vision_start|><|video_pad|><|vision_end|>{% else %}{{ c.text }}{% endif %}"
            "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% endif %}")


def write_tokenizer(folder):
    """A character-level tokenizer over the tiny model's 256 ids: printable ASCII and the newline, Qwen's chat and
    vision tokens at the tiny config's ids, the rest unused names."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    special = {240: "<|im_start|>", 241: "<|im_end|>", **Names.NAMES}
    vocab = {"[UNK]": 0, "\n": 1, **{chr(c): c - 30 for c in range(32, 127)}}
    vocab.update({special.get(i, f"<unused{i}>"): i for i in range(len(vocab), 256)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special.values()])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (folder / "chat_template.jinja").write_text(TEMPLATE)


@pytest.fixture(scope="module")
def model(reference, tmp_path_factory):
    from convert import convert_checkpoint

    dst = convert_checkpoint(reference.hf, tmp_path_factory.mktemp("video-converted") / "qwen3_vl",
                             progress=False).dst
    yield day0jax.load(dst, dtype="float32", kernels="strict", engine=parity_engine())
    jax.clear_caches()
    gc.collect()


def test_logits_with_videos_match_transformers(reference, model):
    for i, (tokens, row) in enumerate(zip(reference.prompts, reference.rows)):
        err = rel_err(model.logits([tokens], images=[row])[0], reference.run[f"logits_{i}"])
        assert err < tolerance("qwen3_vl"), f"case {i}: relative error {err:.2e}"


def test_qwen3_5_logits_with_videos_match_transformers(reference, tmp_path):
    """Qwen3.5 (the tower without DeepStack over the hybrid language model) takes videos the same way."""
    from convert import convert_checkpoint

    dst = convert_checkpoint(reference.hf_qwen3_5, tmp_path / "qwen3_5", progress=False).dst
    model = day0jax.load(dst, dtype="float32", kernels="strict", engine=parity_engine())
    tokens, row = reference.prompts[1], reference.rows[1]
    err = rel_err(model.logits([tokens], images=[row])[0], reference.run_qwen3_5["logits_1"])
    assert err < tolerance("qwen3_5"), f"relative error {err:.2e}"


def test_greedy_decode_with_videos_matches_transformers(reference, model):
    outs = model.generate(reference.prompts, NEW_TOKENS, ignore_eos=True, images=reference.rows)
    for i, out in enumerate(outs):
        assert out == reference.run[f"generated_{i}"].tolist(), f"case {i}"
    # The same tokens over the video's frames reversed read no cached page past the text before the video (whose
    # first page the video's tokens end); the first video again reads its pages back.
    tokens, scheduler = reference.prompts[0], model.engine.scheduler

    def first_token(row):  # through the engine, and the number of prompt tokens it read from the prefix cache
        hits = scheduler.prefix_hit_tokens
        out = model.generate([tokens], 1, ignore_eos=True, images=[row])[0]
        assert out == [int(model.logits([tokens], images=[row])[0, -1].argmax())]  # as without a cache
        return scheduler.prefix_hit_tokens - hits

    assert first_token([Video(list(VIDEOS[0][0][::-1]), VIDEOS[0][1])]) == 0
    assert first_token(reference.rows[0]) >= 16


def gif(array: np.ndarray, duration_ms: int) -> bytes:
    """An animated GIF of uint8 frames, `duration_ms` each."""
    buf = io.BytesIO()
    images = [Image.fromarray(f) for f in array]
    images[0].save(buf, "GIF", save_all=True, append_images=images[1:], duration=duration_ms, loop=0)
    return buf.getvalue()


def test_animated_gif_decodes_to_frames_and_mp4_is_refused():
    array = frames(9, 5, 12, 10) // 51 * 51  # few colours: the GIF palette keeps them exactly
    got, fps = load_video("data:image/gif;base64," + base64.b64encode(gif(array, 250)).decode())
    assert fps == pytest.approx(4.0) and len(got) == 5 and all(g.shape == (12, 10, 3) for g in got)
    mp4 = b"\x00\x00\x00\x18ftypmp42" + bytes(64)
    with pytest.raises(ImageError, match="animated GIF, WebP or PNG"):
        load_video("data:video/mp4;base64," + base64.b64encode(mp4).decode())
    with pytest.raises(ImageError, match="above the limit of 3 frames"):
        load_video(gif(array, 250), max_frames=3)
    with pytest.raises(ImageError, match="pixels over all frames"):
        load_video(gif(array, 250), max_pixels=500)


def gif_url(array: np.ndarray, duration_ms: int = 100) -> str:
    return "data:image/gif;base64," + base64.b64encode(gif(array, duration_ms)).decode()


def test_served_gif_video_gives_the_models_tokens(model):
    """An image and an animated GIF in one user message, served: the prompt's tokens (usage) and the greedy tokens
    are those of `Model.prepare` and `Model.generate`; an mp4 and a GIF over --max-image-pixels get a 400 naming
    the part, while the server keeps serving."""
    clip = frames(11, 24, 24, 32) // 51 * 51  # 10 fps: frames 0, 8, 15, 23 sampled at 2 fps, two frame pairs
    still = np.random.default_rng(12).integers(0, 256, (20, 28, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(still).save(png, "PNG")
    messages = [{"role": "user", "content": [
        {"type": "image_url",
         "image_url": {"url": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()}},
        {"type": "text", "text": "What happens next?"}, {"type": "video_url", "video_url": {"url": gif_url(clip)}}]}]
    ids, row = model.prepare(messages)
    text = model.tokenizer.decode(ids)
    assert "<0.4 seconds><|vision_start|>" in text and "<1.9 seconds>" in text and ids.count(VIDEO_TOKEN) == 2 * 12
    want = model.generate([ids], 8, ignore_eos=True, images=[row])[0]
    tok = model.tokenizer
    big = frames(13, 4, 80, 80) // 51 * 51  # 25600 pixels over its frames; the clip has 18432
    mp4 = "data:video/mp4;base64," + base64.b64encode(b"\x00\x00\x00\x18ftypmp42" + bytes(64)).decode()
    with serving(["--model", str(model.path), "--dtype", "float32", "--max-num-seqs", "4", "--chunk-sizes", "128",
                  "--max-model-len", "256", "--min-width", "256", "--max-image-pixels", "20000"]) as proc:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        r = client.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0,
                                           logprobs=True, extra_body={"ignore_eos": True})
        assert [t.token for t in r.choices[0].logprobs.content] == [tok.decode([t]) for t in want]
        assert r.usage.prompt_tokens == len(ids)
        for url, words in ((mp4, "animated GIF, WebP or PNG"), (gif_url(big), "pixels over all frames")):
            bad = [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                {"type": "video_url", "video_url": {"url": url}}]}]
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model=name, messages=bad, max_tokens=2)
            assert words in str(e.value) and e.value.body["param"] == "messages[0].content[1].video_url"


def test_video_parts_and_keywords_are_checked():
    clip = list(frames(14, 4, 16, 16))
    part = Video.from_part({"type": "video", "video": clip, "video_metadata": {"fps": 8}, "num_frames": 2,
                            "fps": None})
    assert part.source_fps == 8 and part.options == {"num_frames": 2, "fps": None}
    with pytest.raises(ImageError, match="known are"):
        Video.from_part({"type": "video", "video": clip, "sample_rate": 2})
    processor = Qwen3VLVideoProcessor(VIDEO_PROCESSOR)
    with pytest.raises(ImageError, match="mutually exclusive"):  # the checkpoint's fps stays unless set to None
        processor.preprocess(Video(clip, 8, {"num_frames": 2}))
    with pytest.raises(ImageError, match="share one size"):
        processor.preprocess(Video(clip[:3] + [frames(15, 1, 16, 8)[0]]))


def test_a_long_video_runs_in_calls_that_fit_the_largest_program(model):
    """A video whose patches pass the largest tower program (here made small) runs as calls of whole temporal
    patches that each fit it, so a long video takes the programs warm-up compiled, with the features and DeepStack
    features of the single call that holds it whole (the tower works inside each temporal patch). Worst seen:
    4.5e-8 absolute (the padded length changes the order of the sums)."""
    import dataclasses

    from day0jax.vision.spec import encode_host

    runner = model.engine.runner
    spec = runner.vision
    inputs = model.images.inputs([Video(list(frames(8, 12, 20, 20)), 4, {"do_sample_frames": False})])
    (t, h, w), = inputs.grids
    assert t == 6
    small = dataclasses.replace(spec, encoder=dataclasses.replace(spec.encoder, sizes=(4 * h * w,), limit=None))
    calls = small.encoder_calls(inputs.pixels, inputs.grids)
    assert [(key, tokens) for key, _, tokens in calls] == [((4 * h * w,), h * w), ((4 * h * w,), h * w // 2)]
    assert {key for key, _, _ in calls} <= set(small.encoder.keys())
    assert len(spec.encoder_calls(inputs.pixels, inputs.grids)) == 1

    def run(key, arrays):
        return runner._encode(runner.stage_params[0], *arrays)

    whole, whole_deep = encode_host(spec, inputs.pixels, inputs.grids, run)
    split, split_deep = encode_host(small, inputs.pixels, inputs.grids, run)
    assert whole.shape == split.shape == (t * h * w // 4, whole.shape[1]) and whole_deep.shape == split_deep.shape
    np.testing.assert_allclose(split, whole, rtol=0, atol=2e-7)
    np.testing.assert_allclose(split_deep, whole_deep, rtol=0, atol=2e-7)
