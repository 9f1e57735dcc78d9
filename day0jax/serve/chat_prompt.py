"""A chat request's messages -> the prompt's token ids and, for a vision-language model, its images.

One path for every chat: the messages (and the offered tools) through the chat template, then tokenized. Image parts
are decoded (data: URLs, or file:// URLs inside the server's --allowed-media-dir; nothing is fetched), shown to the
template as `{"type": "image"}` parts, each placeholder expanded as the model family's processor expands it, and the
images preprocessed for the engine. A bad image fails its own request with a 400 before anything reaches the engine.
"""

from __future__ import annotations

import asyncio
from typing import Any

from day0jax.engine.requests import ImageInputs
from day0jax.errors import GenerationError
from day0jax.serve import protocol as P
from day0jax.serve.constraints import template_message
from day0jax.serve.errors import APIError
from day0jax.serve.state import ServerState
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
            undecodable data URL, an http(s) URL, a file:// URL outside --allowed-media-dir or without one), the
            checks of `image_parts`, or a chat template that fails or does not show each image once.
    """
    parts = image_parts(state, body)
    return await asyncio.to_thread(_render, state, body.messages, tools, parts)


def _render(state: ServerState, messages: list[P.ChatMessage], tools: list[dict] | None,
            parts: list[tuple[int, int, P.ImagePart]]) -> tuple[list[int], ImageInputs | None]:
    from day0jax.models.vision_language import chat_images
    from day0jax.vision.images import ImageError, load_image

    decoded: dict[int, dict[int, Any]] = {}
    for i, j, part in parts:
        try:
            image = load_image(part.image_url.url, allowed_media_dir=state.allowed_media_dir)
        except ImageError as e:
            raise APIError(400, str(e), param=f"messages[{i}].content[{j}].image_url") from None
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
            text, pixels = state.model.expand_images(text, images)
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
