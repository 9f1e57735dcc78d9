"""Images in chat requests: `image_url` content parts served by a live server (a tiny random LLaVA: CLIP tower,
projector, the tiny Llama with SmolLM2's tokenizer plus an "<image>" token) through the official `openai` client.

The server's tokens are compared with `Model.generate` on the same checkpoint in this process, fed with
`Model.prepare` of the same messages: equal tokens mean the server rendered, expanded, decoded and preprocessed the
images as the model's own path does, and handed them to the engine. The random model's greedy output depends on the
image (checked), so a server that dropped or swapped images would fail. Then the 400s, each naming its parameter,
while a good request runs beside them: malformed, truncated or unknown images, and images over the server's limits
on encoded bytes and on pixels (a decompression bomb's header is enough: it is refused before any pixel is decoded).
"""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from serve_tiny import write_tiny_chat_checkpoint, write_tiny_vision_checkpoint  # noqa: E402

import day0jax  # noqa: E402
from day0jax.serve import protocol as P  # noqa: E402
from day0jax.serve.render import chat as chat_prompt  # noqa: E402
from day0jax.serve.errors import APIError  # noqa: E402
from day0jax.serve.state import ServerState  # noqa: E402
from launch import serving  # noqa: E402

MODEL = "tiny-vision"
MAX_IMAGES = 3
MAX_IMAGE_BYTES = 200_000  # low, so a 300x300 noise PNG is over it
MAX_IMAGE_PIXELS = 1_000_000
NEW_TOKENS = 8
TOP = 5  # top log-probabilities compared
LOGPROB_TOL = 1e-3  # the engine's paged, chunked prefill against a full forward pass, both float32
FLAGS = ["--dtype", "float32", "--max-num-seqs", "4", "--chunk-sizes", "128", "--max-model-len", "256",
         "--min-width", "256"]


def image(seed: int) -> np.ndarray:
    """A random uint8 RGB image of an odd size (the preprocessing resizes and crops it to 28x28)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (int(rng.integers(20, 60)), int(rng.integers(20, 60)), 3), dtype=np.uint8)


def png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, "PNG")
    return buf.getvalue()


def data_url(array: np.ndarray | bytes) -> str:
    """A data URL of `array` as a PNG, or of these encoded bytes, declared as image/png whatever they are."""
    data = array if isinstance(array, bytes) else png(array)
    return "data:image/png;base64," + base64.b64encode(data).decode()


def noise(seed: int, size: int = 300) -> np.ndarray:
    """A size x size RGB noise image: its PNG barely compresses (about 3 bytes a pixel)."""
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height RGB pixels, then the first 64 rows, all black, compressed to a
    few kilobytes: a decompression bomb's shape (a small file, a huge canvas) without its cost to build (Pillow
    would decode it, the missing rows left black)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, RGB, deflate, no filter, no interlace
    rows = zlib.compress(b"\0" * (1 + 3 * width) * 64, 9)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


def image_part(url: str, detail: str | None = None) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}}


def chat(*parts) -> list[dict]:
    """A system message, then one user message of these content parts (strings are text parts)."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    """The tiny LLaVA: loaded here (the reference), and served with a media folder holding one PNG."""
    root = tmp_path_factory.mktemp("serve-vision")
    ckpt = write_tiny_vision_checkpoint(root)
    media = root / "media"
    media.mkdir()
    (media / "a.png").write_bytes(png(image(0)))
    (media / "big.png").write_bytes(png(noise(1)))
    (root / "outside.png").write_bytes(png(image(0)))
    model = day0jax.load(ckpt, dtype="float32")
    with serving(["--model", str(ckpt), "--allowed-media-dir", str(media), "--max-images-per-request",
                  str(MAX_IMAGES), "--max-image-bytes", str(MAX_IMAGE_BYTES), "--max-image-pixels",
                  str(MAX_IMAGE_PIXELS), *FLAGS]) as proc:
        yield dict(model=model, server=proc, root=root, media=media,
                   client=openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=120))


def reference(model, messages: list[dict]) -> tuple[list[int], list[int], np.ndarray]:
    """(prompt ids, greedy new tokens, log-probabilities of the first new token [V]) of `messages` by the model's own
    path (`prepare`, then `generate`, and `logits`: a full forward pass)."""
    ids, images = model.prepare(messages)
    logits = model.logits([ids], images=[images])[0, -1].astype(np.float64)
    logprobs = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    return ids, model.generate([ids], NEW_TOKENS, ignore_eos=True, images=[images])[0], logprobs


def served(client, messages: list[dict], stream: bool = False):
    """(token texts, text, usage, the first token's top log-probabilities {token text: logprob}) of a greedy
    request; streamed, with usage, when `stream`."""
    kwargs = dict(model=MODEL, messages=messages, max_tokens=NEW_TOKENS, temperature=0, logprobs=True,
                  top_logprobs=TOP, extra_body={"ignore_eos": True})
    if not stream:
        r = client.chat.completions.create(**kwargs)
        content = r.choices[0].logprobs.content
        text, usage = r.choices[0].message.content, r.usage
    else:
        chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        content = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
        text, usage = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage
    return [t.token for t in content], text, usage, {t.token: t.logprob for t in content[0].top_logprobs}


def check_served(vision, messages: list[dict]) -> tuple[list[int], np.ndarray]:
    """Asserts the server's tokens, plain and streamed, are the model's, and its first token's top log-probabilities
    those of a full forward pass; returns (the tokens, the first token's log-probabilities)."""
    model = vision["model"]
    ids, want, logprobs = reference(model, messages)
    tok = model.tokenizer
    top = np.argsort(-logprobs)[:TOP]
    for stream in (False, True):
        tokens, text, usage, first = served(vision["client"], messages, stream)
        assert tokens == [tok.decode([t]) for t in want], f"stream={stream}"
        assert text == tok.decode(want, skip_special_tokens=True)
        assert usage.prompt_tokens == len(ids) and usage.completion_tokens == len(want) == NEW_TOKENS
        assert sorted(first) == sorted(tok.decode([int(t)]) for t in top)
        for t in top:
            assert abs(first[tok.decode([int(t)])] - logprobs[t]) < LOGPROB_TOL, f"stream={stream}"
    return want, logprobs


def test_one_image_with_text_gives_the_models_tokens(vision):
    model = vision["model"]
    ids, _ = model.prepare(chat("What is in this picture?", image_part(data_url(image(0)))))
    # The prompt holds the expanded placeholder: usage counts those tokens.
    assert ids.count(model.vision.image_token_id) == model.vision.tokens_per_image == 4
    _, first = check_served(vision, chat("What is in this picture?", image_part(data_url(image(0)), "auto")))
    # Another image, same text: other log-probabilities (far beyond the tolerance), so the image reaches the model.
    _, other = check_served(vision, chat("What is in this picture?", image_part(data_url(image(3)), "high")))
    assert np.abs(first - other).max() > 100 * LOGPROB_TOL


def test_two_images_in_one_message(vision):
    a, b = image_part(data_url(image(0)), "low"), image_part(data_url(image(3)))
    _, logprobs = check_served(vision, chat("Compare", a, "with", b, "please."))
    # Swapped, the images give other log-probabilities (far beyond the tolerance): the server keeps their order.
    _, _, swapped = reference(vision["model"], chat("Compare", b, "with", a, "please."))
    assert np.abs(logprobs - swapped).max() > 100 * LOGPROB_TOL


def test_file_url_inside_the_allowed_folder(vision):
    via_file = served(vision["client"], chat("What is this?", image_part((vision["media"] / "a.png").as_uri())))
    via_data = served(vision["client"], chat("What is this?", image_part(data_url(image(0)))))
    assert via_file[0] == via_data[0] and via_file[2].prompt_tokens == via_data[2].prompt_tokens
    assert via_file[3] == pytest.approx(via_data[3], abs=LOGPROB_TOL)


def test_images_and_tools_render_through_one_template(vision):
    """The template gets `tools=` beside the image parts: the prompt is the tool-aware rendering with the image
    expanded, and a forced call comes back as a tool call."""
    model = vision["model"]
    tools = [{"type": "function", "function": {"name": "describe", "parameters": {
        "type": "object", "properties": {"what": {"type": "string", "maxLength": 12}}, "required": ["what"],
        "additionalProperties": False}}}]
    messages = chat("Describe it.", image_part(data_url(image(0))))
    state = ServerState(model_name=MODEL, tokenizer=model.tokenizer, model=model)
    body = P.ChatCompletionRequest.model_validate({"model": MODEL, "messages": messages, "tools": tools})
    ids, images = asyncio.run(chat_prompt(state, body, tools))
    text = model.tokenizer.render_chat([messages[0], {"role": "user", "content": [
        {"type": "text", "text": "Describe it."}, {"type": "image"}]}], tools=tools)
    expanded, inputs = model.images.expand(text, [image(0)], model.tokenizer)
    assert ids == model.tokenizer.encode(expanded, add_special_tokens=False) and "describe" in text
    assert np.array_equal(images.pixels, inputs.pixels)
    r = vision["client"].chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="required",
                                                 max_tokens=60, temperature=1.0, seed=0, parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    assert r.choices[0].message.tool_calls[0].function.name == "describe"
    assert r.usage.prompt_tokens == len(ids)


def bad_requests(vision) -> list[tuple[list[dict], str, str]]:
    """(messages, the param the 400 names, a piece of its message)."""
    outside = (vision["root"] / "outside.png").as_uri()
    good = image_part(data_url(image(0)))
    truncated = png(image(5))
    truncated = truncated[:len(truncated) // 2]
    bmp = io.BytesIO()
    Image.fromarray(image(0)).save(bmp, "BMP")
    flat = io.BytesIO()  # a real, valid 2.25-megapixel PNG of one colour: 5 KB, over the pixel limit only
    Image.new("L", (1500, 1500), 7).save(flat, "PNG")
    big, big_file = png(noise(2)), vision["media"] / "big.png"
    assert len(big) > MAX_IMAGE_BYTES and big_file.stat().st_size > MAX_IMAGE_BYTES
    too_many = f"above the limit of {MAX_IMAGE_PIXELS} pixels"
    too_large = f"limit of {MAX_IMAGE_BYTES} bytes per image (--max-image-bytes)"
    return [
        (chat("x", image_part("data:image/png;base64,@@not base64@@")), "messages[1].content[1].image_url",
         "bad base64"),
        (chat("x", image_part("data:image/png;base64," + base64.b64encode(b"not a png").decode())),
         "messages[1].content[1].image_url", "cannot identify the image"),
        (chat(image_part("https://example.com/cat.png"), "x"), "messages[1].content[0].image_url", "never fetches"),
        (chat("x", good, image_part(outside)), "messages[1].content[2].image_url", "outside the allowed media"),
        (chat("x", image_part((vision["media"] / "missing.png").as_uri())), "messages[1].content[1].image_url",
         "no such file"),
        (chat("x", image_part(data_url(truncated))), "messages[1].content[1].image_url", "image file is truncated"),
        (chat("x", good, image_part(data_url(bmp.getvalue()))), "messages[1].content[2].image_url",
         "not a PNG, JPEG, WebP or GIF file"),
        # Bombs: the declared size and the server's limit in the message, before any pixel is decoded.
        (chat("x", image_part(data_url(png_header(8000, 8000)))), "messages[1].content[1].image_url",
         f"image of 8000x8000 = 64000000 pixels is {too_many}"),
        (chat(image_part(data_url(flat.getvalue())), "x"), "messages[1].content[0].image_url",
         f"1500x1500 = 2250000 pixels is {too_many}"),
        # Above Pillow's own ceiling (about 179 megapixels) Pillow refuses it while reading the header.
        (chat("x", image_part(data_url(png_header(20000, 20000)))), "messages[1].content[1].image_url",
         "decompression bomb"),
        # Over the byte limit: the exact decoded size of a data URL, the size of a file.
        (chat("x", image_part(data_url(big))), "messages[1].content[1].image_url",
         f"the image is {len(big)} bytes, above this server's {too_large}"),
        (chat("x", good, image_part(big_file.as_uri())), "messages[1].content[2].image_url",
         f"the image is {big_file.stat().st_size} bytes, above this server's {too_large}"),
        (chat("x", *[good] * (MAX_IMAGES + 1)), "messages", f"at most {MAX_IMAGES}"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [good]}],
         "messages[1].content[0]", "user messages only"),
        # The placeholder spelled out in text, with or without images: never an image without its pixels.
        (chat("look: <image>"), "messages", "image placeholder"),
        (chat("look: <image>", good), "messages", "image placeholder"),
    ]


def post(url: str, messages: list[dict], **extra) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": messages, "max_tokens": 4, **extra})


def test_bad_images_are_400s_naming_the_part(vision):
    for messages, param, message in bad_requests(vision):
        r = post(vision["server"].url, messages)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and message in error["message"], error
        assert error["type"] == "invalid_request_error"
    # The official client raises them as BadRequestError; a detail OpenAI does not define is refused by the schema.
    with pytest.raises(openai.BadRequestError):
        vision["client"].chat.completions.create(model=MODEL, messages=chat(image_part("http://x/a.png")),
                                                 max_tokens=4)
    assert post(vision["server"].url, chat(image_part(data_url(image(0)), "ultra"))).status_code == 400


def test_file_urls_without_an_allowed_folder_are_refused(vision):
    model = vision["model"]
    state = ServerState(model_name=MODEL, tokenizer=model.tokenizer, model=model)  # no --allowed-media-dir
    body = P.ChatCompletionRequest.model_validate({"model": MODEL, "messages": chat(
        "x", image_part((vision["media"] / "a.png").as_uri()))})
    with pytest.raises(APIError) as e:
        asyncio.run(chat_prompt(state, body, None))
    assert e.value.status == 400 and e.value.param == "messages[1].content[1].image_url"
    assert "--allowed-media-dir" in e.value.message


def test_image_limits_are_exact(vision):
    """An image at either limit is taken, one byte or one pixel over is refused: the byte limit counts a data URL's
    decoded payload (not its line breaks and padding) and a file's size, the pixel limit width * height."""
    model = vision["model"]

    def prompt(url: str, **limits) -> list[int]:
        state = ServerState(model_name=MODEL, tokenizer=model.tokenizer, model=model,
                            allowed_media_dir=str(vision["media"]), **limits)
        body = P.ChatCompletionRequest.model_validate({"model": MODEL, "messages": chat("x", image_part(url))})
        return asyncio.run(chat_prompt(state, body, None))[0]

    def refused(url: str, message: str, **limits) -> None:
        with pytest.raises(APIError) as e:
            prompt(url, **limits)
        assert e.value.status == 400 and e.value.param == "messages[1].content[1].image_url"
        assert message in e.value.message, e.value.message

    array = image(7)
    data = png(array)
    wrapped = "data:image/png;base64," + base64.encodebytes(data).decode()  # MIME lines of 76 characters
    # The quick bound (3/4 of the payload's characters) is over the limit here: the exact count decides.
    assert len(wrapped.partition(",")[2]) * 3 // 4 > len(data)
    want = prompt(data_url(array))
    assert prompt(wrapped, max_image_bytes=len(data)) == want
    refused(wrapped, f"the image is {len(data)} bytes, above this server's limit of {len(data) - 1} bytes",
            max_image_bytes=len(data) - 1)
    file_url, size = (vision["media"] / "a.png").as_uri(), (vision["media"] / "a.png").stat().st_size
    assert prompt(file_url, max_image_bytes=size) == prompt(data_url(image(0)))
    refused(file_url, f"the image is {size} bytes", max_image_bytes=size - 1)
    height, width = array.shape[:2]
    assert prompt(data_url(array), max_image_pixels=width * height) == want
    refused(data_url(array), f"image of {width}x{height} = {width * height} pixels is above the limit of "
            f"{width * height - 1} pixels", max_image_pixels=width * height - 1)


def test_images_in_flight_share_the_servers_image_memory(vision):
    """All requests' images count against one budget: decoded while a request renders, its preprocessed pixels until
    it ends. Images that do not fit while another request holds its own get 429; images that never could, 400
    naming the part; the memory comes back when a request ends or is only rendered (/tokenize)."""
    from types import SimpleNamespace

    from day0jax.serve import render, submit

    model = vision["model"]
    array = image(0)
    body = P.ChatCompletionRequest.model_validate({"model": MODEL, "messages": chat("x", image_part(data_url(array)))})
    decoded = array.shape[0] * array.shape[1] * 3  # RGB, one byte a channel

    def state_with(limit: int) -> ServerState:
        return ServerState(model_name=MODEL, tokenizer=model.tokenizer, model=model, max_image_memory=limit)

    state = state_with(1 << 30)
    _, images = asyncio.run(chat_prompt(state, body, None))
    pixels = images.pixels.nbytes
    assert state.image_memory.held == pixels  # the decoded image given back once preprocessed
    render.release(state, images)
    assert state.image_memory.held == 0

    state = state_with(max(pixels, decoded))  # one request's images fit, not two requests'
    _, first = asyncio.run(chat_prompt(state, body, None))
    with pytest.raises(APIError) as busy:
        asyncio.run(chat_prompt(state, body, None))
    assert busy.value.status == 429 and busy.value.code == "image_memory_full"
    assert state.image_memory.held == pixels  # the refused request holds nothing
    run = submit.Run("r", SimpleNamespace(release=lambda *a, **k: None), state, [], 1, 1, image_bytes=pixels)
    run.release(completed=True)  # the first request ends
    assert state.image_memory.held == 0
    _, second = asyncio.run(chat_prompt(state, body, None))
    render.release(state, second)

    with pytest.raises(APIError) as never:
        asyncio.run(chat_prompt(state_with(decoded - 1), body, None))
    assert never.value.status == 400 and never.value.param == "messages[1].content[1].image_url"


def test_image_limit_flags_default_to_the_states_defaults():
    from day0jax.serve.__main__ import parse_args

    args, state = parse_args([]), ServerState(model_name=MODEL)
    assert (args.max_image_bytes, args.max_image_pixels) == (state.max_image_bytes, state.max_image_pixels)
    assert (state.max_image_bytes, state.max_image_pixels) == (20 << 20, 40_000_000)
    assert args.max_image_memory_mb << 20 == state.max_image_memory == 1 << 30
    args = parse_args(["--max-image-bytes", "1000", "--max-image-pixels", "2000"])
    assert (args.max_image_bytes, args.max_image_pixels) == (1000, 2000)


def test_bad_images_leave_a_concurrent_request_untouched(vision):
    messages = chat("What is in this picture?", image_part(data_url(image(0))))
    _, want, _ = reference(vision["model"], messages)
    tok = vision["model"].tokenizer
    bad = bad_requests(vision) * 3
    with ThreadPoolExecutor(8) as pool:
        good = [pool.submit(served, vision["client"], messages, stream=i % 2 == 1) for i in range(4)]
        codes = list(pool.map(lambda b: post(vision["server"].url, b[0]).status_code, bad))
        results = [g.result() for g in good]
    assert codes == [400] * len(bad)
    assert all(tokens == [tok.decode([t]) for t in want] for tokens, _, _, _ in results)


def test_a_text_only_model_refuses_images(tmp_path):
    ckpt = write_tiny_chat_checkpoint(tmp_path)
    with serving(["--model", str(ckpt), *FLAGS, "--warmup", "none"], timeout=600) as proc:
        r = post(proc.url, chat("x", image_part(data_url(image(0)))), model="tiny-chat")
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "takes no images" in r.json()["error"]["message"]
        # Text parts alone still work.
        r = post(proc.url, chat("Say hi."), model="tiny-chat")
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text


# --- this year's vision-language families through the server --------------------------------------------------

SERVED_FAMILIES = ["kimi_k25", "mistral3", "qwen3_vl_moe", "gemma4", "lfm2_vl"]


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory):
    from conftest import run_reference
    from serve_tiny import write_family_vision_checkpoints

    return write_family_vision_checkpoints(tmp_path_factory.mktemp("serve-families"), SERVED_FAMILIES, run_reference)


@pytest.mark.parametrize("name", SERVED_FAMILIES)
def test_families_serve_images_as_the_model_runs_them(family_checkpoints, name):
    """Kimi K2.5 (MoonViT), Mistral 3 (Pixtral: rows of [IMG] ended by [IMG_BREAK] and [IMG_END]), Qwen3-VL-MoE
    (3-D RoPE, DeepStack), Gemma 4 (an image's tokens attending both ways in sliding layers, each image prefilled
    whole) and LFM2-VL (SigLIP2 NaFlex, each image between <|image_start|> and <|image_end|>) served: two images of odd sizes in one message, through the official client, plain and streamed, give
    the tokens and log-probabilities of the model's own `prepare` + `generate`; the prompt holds each image's
    expanded placeholders."""
    ckpt = family_checkpoints[name]
    model = day0jax.load(ckpt, dtype="float32")
    with serving(["--model", str(ckpt), "--warmup", "none", *FLAGS]) as proc:
        vision = dict(model=model, client=openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0,
                                                        timeout=120))
        messages = chat("Compare", image_part(data_url(image(3))), "with", image_part(data_url(image(4))))
        ids, _ = model.prepare(messages)
        inputs = model.images.inputs([image(3), image(4)])
        assert ids.count(model.vision.image_token_id) == sum(inputs.counts) and len(inputs.counts) == 2
        if name == "mistral3":  # each image row by row: a break after every row but the last, which ends it
            tok = model.tokenizer
            brk, end = (tok.encode(t)[-1] for t in ("[IMG_BREAK]", "[IMG_END]"))
            assert ids.count(end) == 2 and ids.count(brk) == sum(g[1] - 1 for g in inputs.grids)
        if name == "lfm2_vl":
            start, end = (model.tokenizer.encode(t)[-1] for t in ("<|image_start|>", "<|image_end|>"))
            assert ids.count(start) == ids.count(end) == 2
        check_served(vision, messages)
