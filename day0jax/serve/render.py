"""Render: a request's prompt as token ids and, for a vision-language model, its images as the engine's image inputs.

A completion's prompts are tokenized (or taken as token ids). A chat goes one path: the messages (and the offered
tools, and the request's template variables: `chat_template_kwargs`, `reasoning_effort`) through the chat template,
then tokenized; for a reasoning model, the end of the prompt says where its output starts (`reasoning`). Image parts
are decoded (data: URLs, or file:// URLs inside the server's --allowed-media-dir; nothing is fetched), shown to the
template as `{"type": "image"}` parts, each placeholder expanded as the model family's processor expands it, and the
images preprocessed for the engine (`_image_inputs`, the one place the model's image methods are called). Each
image's encoded size (--max-image-bytes) and then its declared pixel count (--max-image-pixels, read from the header)
are checked before its pixels are decoded. Rendering runs off the event loop: a long chat or a large image takes
milliseconds other streams would wait.
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.parse
from typing import Any

from day0jax.core.errors import GenerationError
from day0jax.serve import protocol as P
from day0jax.serve.errors import APIError
from day0jax.serve.reasoning import Reasoning
from day0jax.serve.state import ServerState
from day0jax.vision.images import ImageError, load_image
from day0jax.vision.inputs import ImageInputs
from day0jax.weights.tokenizer import ChatTemplateError


async def completion(state: ServerState, prompts: list[str | list[int]]) -> list[list[int]]:
    """The token ids of each prompt (`CompletionRequest.prompts`): texts tokenized, token ids as given.

    Raises:
        APIError: 400 (param "prompt") for no prompt or one that renders to no tokens.
    """
    def tokenize():
        return [state.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    ids = await asyncio.to_thread(tokenize)
    if not ids or any(not p for p in ids):
        raise APIError(400, "prompt must not be empty", param="prompt")
    return ids


async def chat(state: ServerState, body: P.ChatCompletionRequest, tools: list[dict] | None,
               add_generation_prompt: bool = True) -> tuple[list[int], ImageInputs | None]:
    """The prompt of a chat request.

    Args:
        state: the server state (tokenizer, model, image limits and media folder).
        body: the chat request, validated.
        tools: the offered tools as the template takes them (`validate.OfferedTools.specs`), or None.
        add_generation_prompt: end with the assistant turn's opening (what generation needs; /tokenize may not).
    Returns:
        (token ids, with each image's placeholder tokens expanded; the preprocessed images, or None without any).
    Raises:
        APIError: 400 for an image that cannot be read (param `messages[i].content[j].image_url`: a malformed or
            undecodable data URL, an http(s) URL, a file:// URL outside --allowed-media-dir or without one, more
            encoded bytes than `state.max_image_bytes` or more pixels than `state.max_image_pixels`), a chat template
            that fails or does not show each image once, or text that spells the image placeholder.
    """
    return await asyncio.to_thread(_chat, state, body, tools, add_generation_prompt)


def reasoning(state: ServerState, prompt: list[int]) -> Reasoning | None:
    """For a reasoning model (`state.reasoning`), where the output of `prompt` starts: in the reasoning (the template
    opened it), in the answer (it closed it: thinking switched off), or either; None for other models."""
    if state.reasoning is None:
        return None
    tail = state.tokenizer.decode(prompt[-16:], skip_special_tokens=False)
    return Reasoning(state.reasoning, state.reasoning.start(tail))


def release(state: ServerState, images: ImageInputs | None) -> None:
    """Gives the server's image memory back what `chat` took for `images` (once the request ends, or at once where
    they are not used)."""
    if images is not None:
        state.image_memory.give_back(images.pixels.nbytes)


def _chat(state: ServerState, body: P.ChatCompletionRequest, tools: list[dict] | None, add_generation_prompt: bool
          ) -> tuple[list[int], ImageInputs | None]:
    # The decoded images count against the server's image memory while the request renders, their preprocessed
    # pixels from then until it ends (`release`).
    decoded = []
    try:
        images = []
        for i, j, part in body.image_parts():
            if isinstance(part, P.VideoPart):
                param = f"messages[{i}].content[{j}].video_url"
                video = _load_video(state, part.video_url.url, param)
                size = sum(f.nbytes for f in video.frames)
            else:
                param = f"messages[{i}].content[{j}].image_url"
                video = _load_image(state, part.image_url.url, param)
                size = video.width * video.height * len(video.getbands())
            state.image_memory.take(size, param)
            decoded.append(size)
            images.append(video)
        ids, pixels = _render(state, body, tools, add_generation_prompt, images)
    finally:
        state.image_memory.give_back(sum(decoded))
    if pixels is not None:
        state.image_memory.take(pixels.pixels.nbytes, "messages")
    return ids, pixels


def _render(state: ServerState, body: P.ChatCompletionRequest, tools: list[dict] | None, add_generation_prompt: bool,
            images: list) -> tuple[list[int], ImageInputs | None]:
    messages = [template_message(m) for m in body.messages]
    kwargs = body.template_kwargs() | ({"tools": tools} if tools else {})
    try:
        text = state.tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages") from None
    except Exception as e:  # noqa: BLE001 - a template choking on odd messages is the request's problem
        raise APIError(400, f"the chat template could not render these messages: {e}", param="messages") from None
    pixels = None
    if images:
        text, pixels = _image_inputs(state, text, images)
    ids = state.tokenizer.encode(text, add_special_tokens=False)
    vision = getattr(state.model, "vision", None)
    if vision is not None and not images and vision.placeholders(ids).any():
        # Text that spells the placeholder token would reach the engine as an image without pixels.
        marker = state.tokenizer.decode([next(t for t in ids if vision.placeholders([t]).any())])
        raise APIError(400, f"the messages' text holds the image placeholder {marker!r}; send images as image_url "
                       "content parts", param="messages")
    return ids, pixels


def template_message(m: P.ChatMessage) -> dict:
    """A chat message as chat templates take it (as transformers passes them): an assistant's tool-call arguments
    as objects, not JSON text; a message with images keeps its parts, each image as `{"type": "image"}`, else its
    content is its text; an assistant's reasoning as `reasoning_content` (Qwen3, GLM, MiniMax, Kimi, DeepSeek read
    it) and `thinking` (gpt-oss), only when given (templates test whether the key is there)."""
    content: Any = m.text()
    if m.images():
        content = [{"type": "image"} if isinstance(part, P.ImagePart) else {"type": "video"}
                   if isinstance(part, P.VideoPart) else {"type": "text", "text": part.text} for part in m.content]
    out = {"role": m.role, "content": content}
    if m.name:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
    if reasoning is not None and m.role == "assistant":
        out["reasoning_content"] = out["thinking"] = reasoning
    return out


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def _image_inputs(state: ServerState, text: str, images: list[Any]) -> tuple[str, ImageInputs]:
    """The rendered `text` with each image's placeholder expanded, and the images preprocessed for the engine: the
    one call of the model's image methods.

    Raises:
        APIError: 400 (param "messages") for a template that drops images or a checkpoint without its preprocessing.
    """
    try:
        return state.model.images.expand(text, images, state.model.tokenizer)
    except (GenerationError, ImageError) as e:  # ImageError: the processor's own limits, which may be lower
        raise APIError(400, str(e), param="messages") from None


def _load_image(state: ServerState, url: str, param: str):
    """The image at a content part's `url`, decoded once its encoded size and then its declared pixel count are
    known to be within the server's limits.

    Raises:
        APIError: 400 naming `param` for an image that cannot be read or is over a limit.
    """
    try:
        source = _sized_source(state, url, param)
        return load_image(source, allowed_media_dir=state.allowed_media_dir, max_pixels=state.max_image_pixels)
    except ImageError as e:
        raise APIError(400, str(e), param=param) from None


def _load_video(state: ServerState, url: str, param: str):
    """The video at a content part's `url` (an animated GIF, WebP or PNG), decoded once its encoded size, then its
    frame count and its pixels over all frames (--max-image-pixels) are known to be within the server's limits.

    Raises:
        APIError: 400 naming `param` for a video that cannot be read, of another container (mp4...), or over a
            limit.
    """
    from day0jax.vision.video import Video, load_video

    try:
        frames, fps = load_video(_sized_source(state, url, param), allowed_media_dir=state.allowed_media_dir,
                                 max_pixels=state.max_image_pixels)
        return Video(frames, fps)
    except ImageError as e:
        raise APIError(400, str(e), param=param) from None


def _sized_source(state: ServerState, url: str, param: str) -> str | bytes:
    """What `load_image` is given for the image at `url` once its encoded size is known to be within
    `state.max_image_bytes`, nothing decoded yet: a data URL as is, a file:// URL's file as its bytes (read once, no
    more than the limit, so a file that grows after the check cannot slip past it), any other URL as is (refused
    there).

    Args:
        state: the server state (`max_image_bytes`, `allowed_media_dir`).
        url: the content part's `image_url.url`.
        param: the content part, as the errors name it.
    Returns:
        The data URL, the file's bytes, or `url` unchanged for other schemes.
    Raises:
        APIError: 400 naming `param` for an image of more bytes than the limit, or a file that cannot be read.
        ImageError: a file:// URL outside --allowed-media-dir, without one, or naming no file.
    """
    from day0jax.vision.images import allowed_path, open_checked

    url = url.strip()
    scheme, _, rest = url.partition(":")
    limit = state.max_image_bytes
    scheme = scheme.lower()
    if scheme == "data":
        payload = rest.partition(",")[2]
        # Four base64 characters hold three bytes, and whitespace, %-escapes and padding only add characters: the
        # exact count (which copies the payload) is needed only when this bound is over the limit.
        if len(payload) * 3 // 4 > limit:
            size = len(urllib.parse.unquote("".join(payload.split())).rstrip("=")) * 3 // 4
            _check_bytes(size, limit, param)
        return url
    if scheme != "file":
        return url
    path = allowed_path(url, state.allowed_media_dir)
    try:
        with open_checked(path) as f:
            size = os.fstat(f.fileno()).st_size
            _check_bytes(size, limit, param)
            data = f.read(limit + 1)
    except OSError as e:
        raise APIError(400, f"cannot read the image file: {e.strerror or e}", param=param) from None
    _check_bytes(len(data), limit, param)
    return data


def _check_bytes(size: int, limit: int, param: str) -> None:
    if size > limit:
        raise APIError(400, f"the image is {size} bytes, above this server's limit of {limit} bytes per image "
                       "(--max-image-bytes); send a smaller or more compressed image", param=param)
