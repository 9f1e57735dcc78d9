"""Speculative decoding against plain decoding, side by side in one process, on the same engine and programs.

    .venv/bin/python bench/speculative.py [--repeats 3] [--new-tokens 128] [--k 4] [--batches 1,8,16] [--mtp]

The default model (SmolLM2-135M-Instruct, float32, greedy) on one engine with `--speculative ngram`: each request runs
twice, with speculation and with `speculative=False` (plain decoding on the same programs), in a rotating order after
a warm-up of the same shapes; the tokens must be the same (asserted). Decode rate = batch * (N - 1) / (time for N
tokens - time for 1), taking prompt processing out alike on both sides. Tasks: input-grounded ones (rewrite a given
text of about 400 tokens, summarize it, edit a piece of code), where the output copies spans of its input, and free
chat, where it seldom does. Batches of 8 and 16 show speculation turning itself off above `--spec-max-batch`.
With `--mtp`: a tiny random DeepSeek-V3 with one MTP layer: acceptance and step time at k = 1..2 (random weights accept
little), and at k = 1 the step time at full acceptance (forced by the test hook `Speculation.force_accept`)
against a plain step. Prints a table of medians; one run, on the machine at hand (compare only inside one run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

TEXT = (
    "The lighthouse on Gray Point was built in 1871 from granite quarried on the island itself. For more than a "
    "century its keepers lived in the small stone house at the foot of the tower, climbing the one hundred and "
    "twelve steps every evening to light the lamp and every morning to wind the clockwork that turned the lens. "
    "The lens was made in Paris by a firm that also supplied lighthouses in Spain, Chile and Japan; it weighed "
    "nearly four tons and floated on a bath of mercury so that a single push of the hand could set it turning. "
    "In clear weather its beam could be seen from twenty miles out at sea. In fog it was useless, and the keepers "
    "sounded a horn instead, two long blasts every minute, for as long as the fog lasted, sometimes for three days "
    "without a pause. The last keeper, a man named Thomas Reed, left the island in 1968, when the light was "
    "automated and a diesel generator replaced the clockwork. He kept a diary for all of his twenty-two years on "
    "the point, and it records storms, shipwrecks, the birth of his two daughters, and the slow arrival of the "
    "modern world: the first radio in 1934, electric light in the house in 1952, and a telephone cable laid across "
    "the channel in 1961. Today the tower belongs to a local trust that opens it to visitors in the summer months. "
    "The old lens is still in place, although it no longer turns, and the keepers' house has become a small museum "
    "where the diary is kept in a glass case beside the brass horn, a pair of boots, and a photograph of Reed and "
    "his family standing on the rocks below the tower on a windy afternoon.")

CODE = '''def summarize(records):
    total = 0
    count = 0
    largest = None
    for record in records:
        value = record["value"]
        total = total + value
        count = count + 1
        if largest is None or value > largest:
            largest = value
    if count == 0:
        return {"total": 0, "count": 0, "mean": None, "largest": None}
    return {"total": total, "count": count, "mean": total / count, "largest": largest}
'''

GROUNDED = {
    "rewrite": "Rewrite the following text, keeping every sentence, in plain English:\n\n" + TEXT,
    "summarize": "Summarize the following text in a few sentences, reusing its own words:\n\n" + TEXT,
    "code edit": "Rename the variable `count` to `n` in this Python function and show the whole function:\n\n" + CODE,
}
CHAT = {
    "chat: cooking": "What should I cook for dinner tonight? Give me a few ideas.",
    "chat: advice": "How can I get better at waking up early in the morning?",
    "chat: story": "Write a short story about a robot who learns to paint.",
}


def timed(model, prompts, n: int, speculative: bool) -> tuple[float, list]:
    t0 = time.perf_counter()
    out = model.generate(prompts, n, speculative=speculative)
    return time.perf_counter() - t0, out


def decode_rate(model, prompts, n: int, speculative: bool) -> tuple[float, list, dict]:
    """Tokens/s of decoding, prompt processing taken out: batch * (N - 1) / (t(N) - t(1)); the tokens; spec stats
    of the N-token run."""
    t1, _ = timed(model, prompts, 1, speculative)
    before = dict(model.engine.stats())
    tn, out = timed(model, prompts, n, speculative)
    after = model.engine.stats()
    produced = sum(len(o) for o in out) - len(prompts)
    delta = {k: after[k] - before[k] for k in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")}
    return produced / max(tn - t1, 1e-9), out, delta


def run_default(args) -> None:
    import day0jax
    from day0jax.engine.config import EngineConfig, SpeculativeConfig
    from decode import float32_checkpoint

    batches = [int(b) for b in args.batches.split(",")]
    spec = SpeculativeConfig("ngram", num_tokens=args.k, ngram_min=args.ngram_min, ngram_max=args.ngram_max,
                             max_batch=args.spec_max_batch)
    engine = EngineConfig(max_num_seqs=max(batches), max_model_len=1024, min_width=1024, speculative=spec)
    model = day0jax.load(float32_checkpoint(), dtype="float32", engine=engine)
    tok = model.tokenizer
    chat = lambda text: tok.apply_chat_template([{"role": "user", "content": text}])  # noqa: E731
    rows = []
    for batch in batches:
        tasks = {**GROUNDED, **CHAT} if batch == 1 else {"rewrite": GROUNDED["rewrite"], "chat": CHAT["chat: story"]}
        for name, text in tasks.items():
            prompts = [chat(text)] * batch
            for speculative in (True, False):  # warm-up: compiles every shape both take
                decode_rate(model, prompts, args.new_tokens, speculative)
            rates = {True: [], False: []}
            outs, stats = {}, {}
            for r in range(args.repeats):
                for speculative in ((True, False) if r % 2 == 0 else (False, True)):
                    rate, out, delta = decode_rate(model, prompts, args.new_tokens, speculative)
                    rates[speculative].append(rate)
                    outs[speculative] = out
                    if speculative:
                        stats = delta
            assert outs[True] == outs[False], f"{name} at batch {batch}: speculation changed the tokens"
            spec_rate, plain_rate = (statistics.median(rates[s]) for s in (True, False))
            drafted = stats["spec_draft_tokens"]
            rows.append((batch, name, plain_rate, spec_rate, spec_rate / plain_rate,
                         f"{stats['spec_accepted_tokens']}/{drafted}" if drafted else "-",
                         1 + stats["spec_accepted_tokens"] / stats["spec_drafts"] if stats["spec_drafts"] else 0.0))
            print(f"batch {batch} {name}: plain {plain_rate:.1f} tok/s, ngram k={args.k} {spec_rate:.1f} tok/s "
                  f"({spec_rate / plain_rate:.2f}x)", file=sys.stderr, flush=True)
    print(f"\nSmolLM2-135M-Instruct float32, greedy, {args.new_tokens} new tokens, ngram k={args.k} "
          f"(n-grams {args.ngram_min}-{args.ngram_max}), --spec-max-batch {spec.rows}; median of {args.repeats}\n")
    print("| batch | task | plain tok/s | speculative tok/s | speedup | accepted/drafted | mean acceptance length |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for batch, name, plain, spec_rate, speedup, acc, mean in rows:
        print(f"| {batch} | {name} | {plain:.1f} | {spec_rate:.1f} | {speedup:.2f}x | {acc} | "
              f"{mean:.2f} |" if mean else f"| {batch} | {name} | {plain:.1f} | {spec_rate:.1f} | {speedup:.2f}x | "
              f"{acc} | - |")


def run_mtp(args) -> None:
    """A tiny random DeepSeek-V3 with an MTP layer: step times of plain decoding and of MTP speculation."""
    import jax.numpy as jnp
    from flax import nnx

    from day0jax import models
    from day0jax.engine.config import EngineConfig, SpeculativeConfig
    from day0jax.engine.engine import Engine
    from day0jax.engine.requests import SamplingParams
    from sharding.mesh import make_mesh

    hf = dict(model_type="deepseek_v3", vocab_size=4096, hidden_size=256, intermediate_size=512,
              num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, n_routed_experts=8,
              num_experts_per_tok=2, moe_intermediate_size=128, q_lora_rank=64, kv_lora_rank=64,
              qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_group=2, topk_group=1,
              first_k_dense_replace=1, max_position_embeddings=512, num_nextn_predict_layers=1)
    cfg = models.config_from_hf(hf)
    with nnx.use_eager_sharding(False):
        module = models.family("deepseek_v3").model(cfg, rngs=nnx.Rngs(0), mtp=True)
    prompt = list(range(5, 69))
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    rows = []

    def steps(engine) -> tuple[float, int]:
        """Seconds per decode step over one request (prefill excluded), and steps."""
        engine.add_request("warm", prompt, params)
        while engine.has_work():
            engine.step()
        engine.add_request("r", prompt, params)
        engine.step()  # prefill
        engine.step()
        n, t0 = 0, time.perf_counter()
        while engine.has_work():
            engine.step()
            n += 1
        return (time.perf_counter() - t0) / max(n, 1), n

    base = dict(page_size=16, max_num_seqs=1, max_model_len=512, min_width=512, chunk_buckets=(64,))
    plain = Engine(module, make_mesh(None), jnp.float32, context_length=512, config=EngineConfig(**base))
    plain_step = min(steps(plain)[0] for _ in range(args.repeats))
    rows.append(("plain", 0, plain_step, "-", 1.0))
    for k, force in ((1, False), (2, False), (1, True)):
        engine = Engine(module, make_mesh(None), jnp.float32, context_length=512,
                        config=EngineConfig(**base, speculative=SpeculativeConfig("mtp", num_tokens=k)))
        engine.spec.backoff = False
        engine.spec.force_accept = force
        step = min(steps(engine)[0] for _ in range(args.repeats))
        s = engine.spec.stats
        rows.append((f"mtp{' (all accepted)' if force else ''}", k, step, f"{s.accepted_tokens}/{s.draft_tokens}",
                     s.mean_acceptance_length))
    print(f"\ntiny random DeepSeek-V3 (4 layers, D 256, 8 experts) + 1 MTP layer, float32, batch 1; best of "
          f"{args.repeats}\n")
    print("| run | k | ms per step | step vs plain | accepted/drafted | tokens per step |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, k, step, acc, mean in rows:
        print(f"| {name} | {k or '-'} | {step * 1e3:.2f} | {step / plain_step:.2f}x | {acc} | {mean:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--spec-max-batch", type=int, default=None)
    ap.add_argument("--mtp", action="store_true", help="also the MTP run on a tiny model")
    ap.add_argument("--only-mtp", action="store_true")
    args = ap.parse_args()
    if not args.only_mtp:
        run_default(args)
    if args.mtp or args.only_mtp:
        run_mtp(args)


if __name__ == "__main__":
    main()
