"""Tokenizer files from GGUF metadata, built to tokenize exactly as transformers does for the same file.

Rebuilt from the vocabulary, merges, token types and chat template in the metadata (llama.cpp's keys), so the
converted checkpoint stands alone. Vocabularies: `gpt2` (byte-level BPE) and `llama` (SentencePiece-style BPE with
byte fallback).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from day0jax.core.errors import CheckpointError

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

# Pre-tokenizer split patterns for byte-level vocabularies, by `tokenizer.ggml.pre` (as transformers maps them).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "falcon3": _LLAMA3, "dbrx": _LLAMA3,
          "smaug-bpe": _LLAMA3, "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level(tokens: list[str], merges: list[str], pre: str | None) -> Tokenizer:
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, [tuple(m.split(" ")) for m in merges], dropout=None,
                               continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = SPLITS.get(pre)
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                              use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens, best score first."""
    vocab = {t: i for i, t in enumerate(tokens)}
    scored = dict(zip(tokens, scores))
    merges = []
    for piece, score in scored.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _sentencepiece(tokens: list[str], merges: list[str] | None, scores: list[float] | None) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    if merges:
        pairs = [tuple(m.split(" ")) for m in merges]
    elif scores:
        pairs = _merges_from_scores(tokens, scores)
    else:
        raise CheckpointError("GGUF sentencepiece vocabulary has neither merges nor scores")
    tok = Tokenizer(models.BPE(vocab, pairs, fuse_unk=True, byte_fallback=True, dropout=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1)])
    return tok


def build_tokenizer(meta: dict) -> tuple[Tokenizer, dict]:
    """A `tokenizers.Tokenizer` and the tokenizer_config dict for GGUF metadata `meta`.

    Raises:
        CheckpointError: no vocabulary, or a vocabulary kind we cannot rebuild.
    """
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise CheckpointError("GGUF has no tokenizer.ggml.tokens: cannot build a tokenizer")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        tok = _byte_level(tokens, meta.get("tokenizer.ggml.merges") or [], meta.get("tokenizer.ggml.pre"))
        add_bos = False  # transformers' byte-level GGUF tokenizer adds no BOS whatever the file says
        alphabet = set(byte_alphabet().values())
        control = [t for t, ty in zip(tokens, types) if ty == CONTROL and set(t) <= alphabet]
    elif kind == "llama":
        tok = _sentencepiece(tokens, meta.get("tokenizer.ggml.merges"), meta.get("tokenizer.ggml.scores"))
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
        control = [t for t, ty in zip(tokens, types) if ty == CONTROL]
    else:
        raise CheckpointError(f"GGUF tokenizer.ggml.model={kind!r} is not supported (gpt2 and llama are)")
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    vocab = tok.get_vocab()
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab])

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    def template(seq: str, type_id: int) -> list[str]:
        return ([f"{bos}:{type_id}"] if add_bos and bos else []) + [f"${seq}:{type_id}"] + \
            ([f"{eos}:{type_id}"] if add_eos and eos else [])

    specials = sorted({(t, vocab[t]) for t in (bos if add_bos else None, eos if add_eos else None) if t})
    tok.post_processor = processors.TemplateProcessing(single=" ".join(template("A", 0)),
                                                       pair=" ".join(template("A", 0) + template("B", 1)),
                                                       special_tokens=specials)
    config = {"bos_token": bos, "eos_token": eos, "unk_token": token("unknown_token_id"),
              "pad_token": token("padding_token_id"), "add_bos_token": add_bos, "add_eos_token": add_eos}
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tok, config


def write_tokenizer(meta: dict, hf_config: dict, dst: Path) -> list[str]:
    """Writes tokenizer.json, tokenizer_config.json and generation_config.json into dst; returns their names."""
    tok, config = build_tokenizer(meta)
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    generation = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if hf_config.get(k) is not None}
    (dst / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
