"""Token events to OpenAI text, in-process: stop strings cut the text, and streaming holds back what may still
change (an unfinished UTF-8 character, a possible stop-string prefix) until the next token settles it.
"""

from __future__ import annotations

from day0jax.engine.requests import TokenEvent
from day0jax.serve.stream import Choice, Detokenizer


class ByteTokenizer:
    """Token i is the byte i (so one character may take several tokens)."""

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode("utf-8", errors="replace")


def feed(choice: Choice, text: str) -> tuple[list[str], bool]:
    """Adds `text` byte by byte; returns what was streamable after each token and whether a stop string hit."""
    detok, sent, stopped = Detokenizer(ByteTokenizer()), [], False
    for b in text.encode():
        stopped = choice.add(TokenEvent("r", 0, b), detok)
        sent.append(choice.sendable()[1])
        if stopped:
            break
    return sent, stopped


def test_a_stop_string_cuts_the_text_and_its_prefix_is_never_streamed():
    choice = Choice(0, stops=["END"])
    sent, stopped = feed(choice, "one EN two END three")
    assert stopped and choice.text == "one EN two "
    assert "".join(sent) == "one EN two "[:len("".join(sent))]  # never more than the final text
    assert "EN" not in "".join(sent[:6])  # "EN" was held back while it could have begun "END"
    choice.finish_reason = "stop"
    assert "".join(sent) + choice.sendable()[1] == "one EN two "


def test_an_unfinished_utf8_character_is_held_back():
    choice = Choice(0, stops=[])
    sent, _ = feed(choice, "é🤗")  # 2 + 4 bytes
    assert sent == ["", "é", "", "", "", "🤗"]


class ChunkTokenizer:
    """Token i is `pieces[i]`, any bytes; an unfinished character's bytes decode as one U+FFFD each (as
    byte-fallback tokenizers do), so the text can shrink when a token completes the character."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=False):
        raw = b"".join(self.pieces[i] for i in ids)
        for cut in range(len(raw), -1, -1):
            try:
                return raw[:cut].decode("utf-8") + "\ufffd" * (len(raw) - cut)
            except UnicodeDecodeError:
                continue


def test_a_stop_string_in_the_token_that_completes_a_character_is_found():
    """"€" is 3 bytes: after two of them the text ends in two U+FFFD; the next token brings the last byte and the
    stop string at once, and the text grows by less than the token's characters."""
    pieces = [b"ab", "€".encode()[:2], "€".encode()[2:] + b"X tail"]
    choice = Choice(0, stops=["X"])
    detok = Detokenizer(ChunkTokenizer(pieces))
    stopped = False
    for i in range(len(pieces)):
        stopped = choice.add(TokenEvent("r", 0, i), detok)
        assert "\ufffd" not in choice.sendable()[1]
    assert stopped and choice.text == "ab€"


def test_incremental_text_equals_a_full_decode_at_linear_cost():
    """With SmolLM2's byte-level tokenizer, over random ids (multi-byte characters split across tokens included):
    the text built token by token is the whole output's decode, and decoding it touched O(n) tokens, not O(n^2)."""
    import numpy as np

    from day0jax.default_model import default_checkpoint
    from day0jax.weights.tokenizer import Tokenizer

    tok = Tokenizer(default_checkpoint(progress=False))

    class Counting:
        decoded = 0

        def decode(self, ids, skip_special_tokens=False):
            Counting.decoded += len(ids)
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    rng = np.random.default_rng(0)
    texts = ["naïve café, 日本語 and 🤗 emoji", "plain words " * 20]
    for ids in [tok.encode(t, add_special_tokens=False) for t in texts] + \
            [rng.integers(0, tok.vocab_size, 300).tolist() for _ in range(5)]:
        choice, detok = Choice(0, stops=[]), Detokenizer(Counting())
        Counting.decoded = 0
        for t in ids:
            choice.add(TokenEvent("r", 0, int(t)), detok)
        assert choice.text == tok.decode(ids, skip_special_tokens=True)
        assert Counting.decoded <= 16 * len(ids), Counting.decoded


def test_runs_that_add_no_text_or_never_finish_a_character_cost_linear_time():
    """Hostile outputs for an incremental detokenizer: a long run of special tokens (left out of the text) and a
    long run of bytes that never make a character (each one U+FFFD in the end). The text equals the whole output's
    decode, and decoding touched O(n) tokens: neither run is rescanned per token."""
    from day0jax.default_model import default_checkpoint
    from day0jax.weights.tokenizer import Tokenizer

    tok = Tokenizer(default_checkpoint(progress=False))
    special = tok.token_id("<|im_end|>")

    def counted(inner):
        class Counting:
            decoded = 0

            def decode(self, ids, skip_special_tokens=False):
                Counting.decoded += len(ids)
                return inner.decode(ids, skip_special_tokens=skip_special_tokens)
        return Counting()

    cases = [(tok, tok.encode("Hello", add_special_tokens=False) + [special] * 2000
              + tok.encode(" world", add_special_tokens=False)),
             (ByteTokenizer(), list(b"ok ") + [0x80] * 2000 + list("é".encode()))]
    for inner, ids in cases:
        choice, detok = Choice(0, stops=[]), Detokenizer(counted(inner))
        for t in ids:
            choice.add(TokenEvent("r", 0, t), detok)
        assert choice.text == inner.decode(ids, skip_special_tokens=True)
        # Per token, the context (a settled chunk: at most MAX_UNFINISHED_TOKENS of U+FFFD bytes) and the window
        # beyond it are decoded: ~20 ids a token here; rescanning the run would be ~1000.
        assert detok.tok.decoded <= 32 * len(ids), detok.tok.decoded
