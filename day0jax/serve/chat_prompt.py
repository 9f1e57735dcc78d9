"""A chat request's messages -> the prompt's token ids and, for a vision-language model, its images.

One path for every chat: the messages (and the offered tools) through the chat template, then tokenized. Image parts
are decoded (data: URLs, or file:// URLs inside the server's --allowed-media-dir; nothing is fetched), shown to the
template as `{"type": "image"}` parts, each placeholder expanded as the model family's processor expands it, and the
images preprocessed for the engine. Each image's encoded size (--max-image-bytes) and then its declared pixel count
(--max-image-pixels, read from the header) are checked before its pixels are decoded. A bad image fails its own
request with a 400 before anything reaches the engine.
"""

from __future__ import annotations

import asyncio
import os
import urllib.parse
from typing import Any

from day0jax.core.errors import GenerationError
from day0jax.serve import protocol as P
from day0jax.serve.constraints import template_message
from day0jax.serve.errors import APIError
from day0jax.serve.state import ServerState
from day0jax.vision.inputs import ImageInputs
from day0jax.weights.tokenizer import ChatTemplateError


def image_parts(state: ServerState, body: P.ChatCompletionRequest) -> list[tuple[int, int, P.ImagePart]]:
    """The request's image parts as (message index, part index, part), checked before any is decoded.

    Raises:
        APIError: 400 for an image in a message that is not the user's (naming the part), more images than
            `state.max_images_per_request`, or images for a model that takes none (param "messages").
    """
    parts = [(i, j, part) for i, m in enumerate(body.messages) for j, part in m.images()]
    if not parts:
        return parts
    for i, j, _ in parts:
        if body.messages[i].role != "user":
            raise APIError(400, f"images are accepted in user messages only, not in a {body.messages[i].role} "
                           "message", param=f"messages[{i}].content[{j}]")
    if getattr(state.model, "vision", None) is None:
        raise APIError(400, f"this model takes no images ({state.model_name} is a text-only model); send text only",
                       param="messages")
    if len(parts) > state.max_images_per_request:
        raise APIError(400, f"the messages hold {len(parts)} images; this server takes at most "
                       f"{state.max_images_per_request} per request (--max-images-per-request)", param="messages")
    return parts


async def chat_prompt(state: ServerState, body: P.ChatCompletionRequest, tools: list[dict] | None
                      ) -> tuple[list[int], ImageInputs | None]:
    """The prompt of a chat request, rendered and tokenized off the event loop (a long chat or a large image takes
    milliseconds, which other streams would wait).

    Args:
        state: the server state (tokenizer, model, image limits and media folder).
        body: the chat request.
        tools: the offered tools as the template takes them (`constraints.offered_tools`), or None.
    Returns:
        (token ids, with each image's placeholder tokens expanded; the preprocessed images, or None without any).
    Raises:
        APIError: 400 for an image that cannot be read (param `messages[i].content[j].image_url`: a malformed or
            undecodable data URL, an http(s) URL, a file:// URL outside --allowed-media-dir or without one, more
            encoded bytes than `state.max_image_bytes` or more pixels than `state.max_image_pixels`), the checks of
            `image_parts`, or a chat template that fails or does not show each image once.
    """
    parts = image_parts(state, body)
    return await asyncio.to_thread(_render, state, body.messages, tools, parts)


def _render(state: ServerState, messages: list[P.ChatMessage], tools: list[dict] | None,
            parts: list[tuple[int, int, P.ImagePart]]) -> tuple[list[int], ImageInputs | None]:
    from day0jax.vision.inputs import chat_images
    from day0jax.vision.images import ImageError, load_image

    decoded: dict[int, dict[int, Any]] = {}
    for i, j, part in parts:
        param = f"messages[{i}].content[{j}].image_url"
        try:
            source = _sized_source(state, part.image_url.url, param)
            image = load_image(source, allowed_media_dir=state.allowed_media_dir, max_pixels=state.max_image_pixels)
        except ImageError as e:
            raise APIError(400, str(e), param=param) from None
        decoded.setdefault(i, {})[j] = image
    rendered = [template_message(m, decoded.get(i)) for i, m in enumerate(messages)]
    images: list[Any] = []
    if decoded:
        rendered, images = chat_images(rendered)
    try:
        text = state.tokenizer.render_chat(rendered, add_generation_prompt=True,
                                           **({"tools": tools} if tools else {}))
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages") from None
    except Exception as e:  # noqa: BLE001 - a template choking on odd messages is the request's problem
        raise APIError(400, f"the chat template could not render these messages: {e}", param="messages") from None
    pixels = None
    if images:
        try:
            text, pixels = state.model.images.expand(text, images, state.model.tokenizer)
        except GenerationError as e:  # a template that drops images, a checkpoint without its preprocessing
            raise APIError(400, str(e), param="messages") from None
    ids = state.tokenizer.encode(text, add_special_tokens=False)
    vision = getattr(state.model, "vision", None)
    if vision is not None and not images and vision.image_token_id in ids:
        # Text that spells the placeholder token would reach the engine as an image without pixels.
        marker = state.tokenizer.decode([vision.image_token_id])
        raise APIError(400, f"the messages' text holds the image placeholder {marker!r}; send images as image_url "
                       "content parts", param="messages")
    return ids, pixels


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
    from day0jax.vision.images import allowed_path

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
        with open(path, "rb") as f:
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
