"""The checkpoint's tokenizer: `tokenizers` for text <-> ids, jinja2 for chat templates, as transformers does.

Chat templates render in a sandbox with transformers' environment (a `tojson` that does not escape HTML, ...).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from day0jax.core.errors import CheckpointError

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The chat template raised (`raise_exception`) or failed to render these messages."""


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Encodes, decodes and applies the chat template of a checkpoint folder.

    Raises:
        CheckpointError: tokenizer.json is missing or unreadable.
    """

    def __init__(self, folder: Path):
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{folder}: no tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises its own exception type
            raise CheckpointError(f"{path}: unreadable tokenizer ({e})") from None
        config_path = folder / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.special_tokens = {k: _token_text(self.config.get(k)) for k in SPECIAL_KEYS if self.config.get(k)}
        self.chat_template = self._find_template(folder)
        self._compiled = None
        self._special_ids: frozenset[int] | None = None

    def _find_template(self, folder: Path) -> str | None:
        if (folder / "chat_template.jinja").is_file():
            return (folder / "chat_template.jinja").read_text()
        if (folder / "chat_template.json").is_file():
            return json.loads((folder / "chat_template.json").read_text()).get("chat_template")
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: transformers uses "default"
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        return template

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as the `tokenizers` library serializes it (tokenizer.json's content)."""
        return self._tok.to_str()

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def special_ids(self) -> frozenset[int]:
        """The ids of the special tokens (those decoding leaves out with skip_special_tokens)."""
        if self._special_ids is None:
            self._special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        return self._special_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The chat template applied to `messages`, as text.

        Raises:
            ChatTemplateError: no template, or the template rejected the messages.
        """
        if not self.chat_template:
            raise ChatTemplateError("this checkpoint has no chat template")
        import jinja2

        if self._compiled is None:
            self._compiled = _environment().from_string(self.chat_template)
        try:
            # The request's template variables may name a special token too: theirs win, as in transformers.
            return self._compiled.render(**{**self.special_tokens, **kwargs, "messages": messages,
                                            "add_generation_prompt": add_generation_prompt})
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """Token ids of the rendered chat (special tokens come from the template, none are added)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **kwargs), add_special_tokens=False)


def _environment():
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
