"""Structured output's cost: decode tokens/s with a JSON schema against the same requests without one, at batch 1 and
16 concurrent sequences, on the default model; and the grammar engine's per-token mask time and compile time,
llguidance (what day0jax uses) against outlines-core when it is installed (`pip install outlines-core==0.2.14`).

    .venv/bin/python bench/structured.py [--repeats 5] [--new-tokens 64] [--batches 1,16]

Decode rate = B * (N - 1) / (time for N tokens - time for 1 token), so prefill and the first token are left out;
the schema holds one long string (`minLength` above N tokens' worth), so constrained rows never finish early and
both sides generate the same number of tokens. Constrained and unconstrained runs alternate, after a warm-up of the
same shapes; the median is reported. The mask time is the grammar engine alone on the host (fill one mask row and
advance one token), replaying a schema-valid output of the model token by token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "story": {"type": "string", "minLength": 2000}}, "required": ["title", "story"], "additionalProperties": False}
RECORD = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                       "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}}, "required": ["name", "age", "address"]}


TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": props, "required": list(props)[:2], "additionalProperties": False}}}
    for name, props in [
    ("get_weather", {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}}),
    ("get_time", {"zone": {"type": "string", "pattern": "^UTC[+-][0-9]{1,2}$"}}),
    ("set_alarm", {"hour": {"type": "integer", "minimum": 0, "maximum": 23}, "days": {
        "type": "array", "items": {"enum": ["mon", "tue"]}, "maxItems": 2}, "repeat": {"type": "boolean"}})]]


def decode_rate(model, prompts, n: int, repeats: int, **constraint) -> float:
    def timed(tokens: int) -> float:
        t0 = time.perf_counter()
        outs = model.generate(prompts, tokens, temperature=0.0, ignore_eos=True, **constraint)
        assert all(len(o) == tokens for o in outs), [len(o) for o in outs]
        return time.perf_counter() - t0

    timed(n), timed(1)  # warm-up: every program these shapes use
    rates = []
    for _ in range(repeats):
        rates.append(len(prompts) * (n - 1) / (timed(n) - timed(1)))
    return statistics.median(rates)


def mask_times(model, schema: dict, tokens: list[int]) -> dict[str, float]:
    """llguidance: compile seconds, and microseconds per token to fill a mask and advance, over `tokens`."""
    from day0jax.engine.grammar import GrammarCompiler

    compiler = GrammarCompiler(model.tokenizer.to_json(), int(model.config.vocab_size), model.eos_token_ids)
    t0 = time.perf_counter()
    grammar = compiler.json_schema(schema)
    compile_s = time.perf_counter() - t0
    row = np.zeros(compiler.words, np.int32)
    best = float("inf")
    for _ in range(5):
        m = grammar.matcher()
        t0 = time.perf_counter()
        for t in tokens:
            m.fill(row)
            assert row[t // 32] >> (t % 32) & 1, "the replayed output leaves the grammar"
            m.consume(t)
        best = min(best, (time.perf_counter() - t0) / len(tokens))
    return {"compile_s": compile_s, "us_per_token": best * 1e6}


def tool_grammar_times(model, syntax) -> dict[str, float]:
    """Compile seconds of `syntax`'s forcing grammar over TOOLS, and microseconds per token (fill a mask, advance) on
    a uniform random walk through it, best of 5 walks."""
    from day0jax.engine.grammar import GrammarCompiler

    compiler = GrammarCompiler(model.tokenizer.to_json(), int(model.config.vocab_size), model.eos_token_ids)
    t0 = time.perf_counter()
    grammar = compiler.lark(syntax.grammar(TOOLS, None, {}, parallel=False), "tool_choice")
    compile_s = time.perf_counter() - t0
    row = np.zeros(compiler.words, np.int32)
    rng = np.random.default_rng(0)
    best, n = float("inf"), 0
    for _ in range(5):
        m, n, spent = grammar.matcher(), 0, 0.0
        while not m.done and n < 1000:
            t0 = time.perf_counter()
            m.fill(row)
            spent += time.perf_counter() - t0
            allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
            choices = [t for t in allowed if t not in model.eos_token_ids] or list(allowed)
            t = int(rng.choice(choices))
            t0 = time.perf_counter()
            m.consume(t)
            spent += time.perf_counter() - t0
            n += 1
        assert m.done, f"{syntax.name}: no complete call after {n} tokens"
        best = min(best, spent / n)
    return {"compile_s": compile_s, "us_per_token": best * 1e6, "tokens": n}


def outlines_times(model, schema: dict, tokens: list[int]) -> dict[str, float] | None:
    """The same with outlines-core (its index precomputes every state's allowed tokens), or None if absent."""
    try:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        return None
    from convert.gguf_tokenizer import byte_alphabet

    to_byte = {c: b for b, c in byte_alphabet().items()}
    vocab: dict[bytes, list[int]] = {}
    eos = model.eos_token_ids[0]
    for i in range(model.tokenizer.vocab_size):
        piece = model.tokenizer._tok.id_to_token(i)
        if i == eos or piece is None:
            continue
        raw = bytes(to_byte[c] for c in piece) if all(c in to_byte for c in piece) else piece.encode()
        vocab.setdefault(raw, []).append(i)
    t0 = time.perf_counter()
    regex = build_regex_from_schema(json.dumps(schema), r"( )?")
    index = outlines_core.Index(regex, outlines_core.Vocabulary(eos, vocab))
    compile_s = time.perf_counter() - t0
    words = -(-int(model.config.vocab_size) // 32)
    mask = np.zeros(words, np.int32)
    best = float("inf")
    for _ in range(5):
        guide = outlines_core.Guide(index)
        t0 = time.perf_counter()
        n = 0
        for t in tokens:
            guide.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)
            if not mask[t // 32] >> (t % 32) & 1:
                break  # its regex spells JSON differently (whitespace): time what it took
            guide.advance(t)
            n += 1
        best = min(best, (time.perf_counter() - t0) / max(n, 1))
    return {"compile_s": compile_s, "us_per_token": best * 1e6, "replayed": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,16")
    args = ap.parse_args()

    import day0jax
    from day0jax.engine.config import EngineConfig
    from day0jax.default_model import default_checkpoint

    model = day0jax.load(default_checkpoint(), dtype="float32", engine=EngineConfig(
        max_num_seqs=16, chunk_buckets=(32, 128), max_model_len=512, min_width=512))
    ask = model.tokenizer.apply_chat_template([{"role": "user", "content": "Write a short story, as JSON."}])
    print("decode tokens/s, SmolLM2-135M-Instruct float32, greedy, median of", args.repeats)
    print("| batch | without schema | with schema | ratio |")
    print("|---:|---:|---:|---:|")
    for B in map(int, args.batches.split(",")):
        prompts = [ask] * B
        free, constrained = [], []
        for _ in range(2):  # alternate the two, twice
            free.append(decode_rate(model, prompts, args.new_tokens, args.repeats))
            constrained.append(decode_rate(model, prompts, args.new_tokens, args.repeats, json_schema=SCHEMA))
        f, c = statistics.median(free), statistics.median(constrained)
        print(f"| {B} | {f:.1f} | {c:.1f} | {c / f:.2f} |")

    record = model.generate([model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "A person record as JSON."}])], 96, json_schema=RECORD)[0]
    tokens = [t for t in record if t not in model.eos_token_ids]
    print(f"\ngrammar engine alone, replaying a {len(tokens)}-token record:")
    print("| engine | compile (ms) | mask + advance (us/token) |")
    print("|---|---:|---:|")
    ll = mask_times(model, RECORD, tokens)
    print(f"| llguidance | {ll['compile_s'] * 1e3:.1f} | {ll['us_per_token']:.1f} |")
    oc = outlines_times(model, RECORD, tokens)
    if oc is None:
        print("| outlines-core | not installed | |")
    else:
        note = "" if oc["replayed"] == len(tokens) else f" (first {oc['replayed']} tokens)"
        print(f"| outlines-core | {oc['compile_s'] * 1e3:.1f} | {oc['us_per_token']:.1f}{note} |")

    from day0jax.serve.tools import SYNTAXES

    print("\ntool-call grammars (tool_choice required, three functions), llguidance:")
    print("| syntax | compile (ms) | mask + advance (us/token) | tokens walked |")
    print("|---|---:|---:|---:|")
    for name, syntax in SYNTAXES.items():
        t = tool_grammar_times(model, syntax)
        print(f"| {name} | {t['compile_s'] * 1e3:.1f} | {t['us_per_token']:.1f} | {t['tokens']} |")


if __name__ == "__main__":
    main()
