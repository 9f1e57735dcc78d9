"""Training data: jsonl rows in mlx-lm's formats made token ids, and the batches the trainer takes.

Formats, one example a line:
- `{"messages": [...], "tools"?: [...]}`: rendered with the checkpoint's chat template (no generation prompt);
  with `mask_prompt`, only the last message (which must be the assistant's) counts.
- `{"prompt": ..., "completion": ...}`: the chat [user: prompt, assistant: completion], as mlx-lm renders it;
  with `mask_prompt`, only the completion counts.
- `{"text": ...}`: the tokenizer's encoding with its own special tokens (`tokenizer(text)` in transformers), EOS
  appended unless the ids already end with it.

A batch is its rows padded on the right to the longest; its loss is the mean cross-entropy over every next-token
target that counts (not padding, not a masked prompt), so padding changes nothing (attention is causal).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from day0jax.core.errors import TrainingError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Example:
    """One row's token ids; the targets at positions >= `offset` count (0: all of them)."""

    tokens: tuple[int, ...]
    offset: int = 0


@dataclass(frozen=True)
class Batch:
    """tokens int32 [B, T] (right-padded) and mask float32 [B, T]: 1 where the token is a target that counts
    (predicted from the one before it; position 0 never is)."""

    tokens: np.ndarray
    mask: np.ndarray
    real: np.ndarray | None = None  # bool [B, T]: not padding

    @property
    def targets(self) -> int:
        return int(self.mask[:, 1:].sum())

    @property
    def lengths(self) -> int:
        """Tokens that are not padding, summed over the rows (every token, where `real` is not given)."""
        return int(self.real.sum()) if self.real is not None else self.tokens.size


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a jsonl file (blank lines skipped).

    Raises:
        TrainingError: a line that is not a JSON object, naming the file and line.
    """
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TrainingError(f"{path}:{i}: not JSON ({e})") from None
        if not isinstance(row, dict):
            raise TrainingError(f"{path}:{i}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def eos_id(tokenizer, eos_token_ids: Sequence[int] = ()) -> int | None:
    """The tokenizer's EOS token id (tokenizer_config.json's `eos_token`), else the model's first EOS id."""
    text = tokenizer.special_tokens.get("eos_token")
    found = tokenizer.token_id(text) if text else None
    return found if found is not None else (eos_token_ids[0] if eos_token_ids else None)


def encode(row: dict, tokenizer, *, mask_prompt: bool, eos: int | None, where: str = "row") -> Example:
    """One jsonl row (see the module's formats) -> an `Example`.

    Raises:
        TrainingError: an unknown format, a chat without a template, or `mask_prompt` where the last message is
            not the assistant's.
    """
    if "messages" in row:
        messages, tools = row["messages"], row.get("tools")
        kwargs = {"tools": tools} if tools else {}
        if not messages:
            raise TrainingError(f"{where}: empty messages")
        ids = _chat(tokenizer, messages, False, kwargs, where)
        offset = 0
        if mask_prompt:
            if messages[-1].get("role") != "assistant":
                raise TrainingError(f"{where}: --mask-prompt needs the last message to be the assistant's")
            offset = len(_chat(tokenizer, messages[:-1], True, kwargs, where))
        return Example(tuple(ids), offset)
    if "prompt" in row and "completion" in row:
        messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]
        ids = _chat(tokenizer, messages, False, {}, where)
        offset = len(_chat(tokenizer, messages[:1], True, {}, where)) if mask_prompt else 0
        return Example(tuple(ids), offset)
    if "text" in row:
        if mask_prompt:
            raise TrainingError(f"{where}: --mask-prompt needs prompt/completion or messages rows, not text")
        ids = tokenizer.encode(row["text"], add_special_tokens=True)
        if eos is not None and (not ids or ids[-1] != eos):
            ids = ids + [eos]
        return Example(tuple(ids), 0)
    raise TrainingError(f"{where}: unknown format (keys {sorted(row)}); expected messages, prompt/completion or text")


def _chat(tokenizer, messages, add_generation_prompt: bool, kwargs: dict, where: str) -> list[int]:
    if not tokenizer.chat_template:
        raise TrainingError(f"{where}: chat rows need the checkpoint's chat template, and it has none")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)


def load_split(folder: str | Path, split: str, tokenizer, *, mask_prompt: bool, eos: int | None,
               max_seq_length: int) -> list[Example] | None:
    """`folder/split.jsonl` as `Example`s (rows longer than `max_seq_length` truncated, with a warning), or None
    where the file does not exist."""
    path = Path(folder) / f"{split}.jsonl"
    if not path.is_file():
        return None
    examples, truncated = [], 0
    for i, row in enumerate(read_jsonl(path), 1):
        ex = encode(row, tokenizer, mask_prompt=mask_prompt, eos=eos, where=f"{path}:{i}")
        if len(ex.tokens) > max_seq_length:
            ex, truncated = Example(ex.tokens[:max_seq_length], ex.offset), truncated + 1
        if len(ex.tokens) < 2:
            raise TrainingError(f"{path}:{i}: fewer than two tokens, nothing to predict")
        examples.append(ex)
    if not examples:
        raise TrainingError(f"{path}: no examples")
    if truncated:
        log.warning("%s: %d row(s) longer than --max-seq-length %d were truncated", path, truncated, max_seq_length)
    return examples


def collate(examples: Sequence[Example], pad_id: int = 0, length: int | None = None) -> Batch:
    """The examples as one `Batch`, right-padded to `length` (default: the longest row)."""
    T = max(len(e.tokens) for e in examples) if length is None else length
    tokens = np.full((len(examples), T), pad_id, np.int32)
    mask = np.zeros((len(examples), T), np.float32)
    real = np.zeros((len(examples), T), bool)
    for b, e in enumerate(examples):
        n = len(e.tokens)
        tokens[b, :n] = e.tokens
        mask[b, max(e.offset, 1):n] = 1.0
        real[b, :n] = True
    return Batch(tokens, mask, real)


def order(n: int, *, shuffle: bool, seed: int) -> Iterator[int]:
    """Example indices, endlessly: file order again and again, or each pass a new permutation drawn from
    numpy's `default_rng(seed)` (reproducible for a seed)."""
    rng = np.random.default_rng(seed)
    while True:
        yield from (rng.permutation(n) if shuffle else range(n))


def batches(examples: Sequence[Example], batch_size: int, *, shuffle: bool = True, seed: int = 0, pad_id: int = 0,
            multiple: int = 1, start: int = 0) -> Iterator[Batch]:
    """Endless batches of `batch_size` examples taken in `order` (continuing into the next pass where one ends),
    each padded to its longest row rounded up to `multiple` (fewer shapes to compile; the padding never counts).
    `start`: batches to pass over first (a resumed run's position: the order's draws replayed, nothing collated)."""
    it = order(len(examples), shuffle=shuffle, seed=seed)
    for _ in range(start * batch_size):
        next(it)
    while True:
        chosen = [examples[next(it)] for _ in range(batch_size)]
        longest = max(len(e.tokens) for e in chosen)
        yield collate(chosen, pad_id, -(-longest // multiple) * multiple)


def passes(examples: Sequence[Example], batch_size: int, pad_id: int = 0, multiple: int = 1) -> Iterator[Batch]:
    """One pass over the examples in file order (the last batch may be smaller): for validation and test loss."""
    for i in range(0, len(examples), batch_size):
        chosen = examples[i:i + batch_size]
        longest = max(len(e.tokens) for e in chosen)
        yield collate(chosen, pad_id, -(-longest // multiple) * multiple)


def pad_id_of(tokenizer: Any, eos: int | None) -> int:
    """The tokenizer's pad token id, else EOS, else 0 (padding never counts, any id does)."""
    text = tokenizer.special_tokens.get("pad_token") if tokenizer is not None else None
    found = tokenizer.token_id(text) if text else None
    return found if found is not None else (eos if eos is not None else 0)
