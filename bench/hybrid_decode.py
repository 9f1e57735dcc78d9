"""Decode tokens/s of a model whose cache per sequence is bounded or compressed (linear attention in the Qwen3.5
layout, Mamba2 in the NemotronH layout, DeepSeek-V4's sliding window with compressed and heavily compressed
attention) against transformers, and what its cache costs per sequence against full attention at a long context.

    .venv/bin/python bench/hybrid_decode.py [--layout qwen3_5|nemotron_h|deepseek_v4] [--repeats 5]
        [--new-tokens 64] [--batches 1,8] [--context 8192]

The models are random but wide enough for the weights to dominate (hidden 1024, 8 layers), built by transformers in
.venv-ref and converted; float32, CPU. qwen3_5: 6 Gated DeltaNet, 2 gated full attention, 16 value heads of 64.
nemotron_h: 4 Mamba2 (32 heads of 64 in 8 groups, state 128), 1 attention layer without positions, 3 ReLU-squared
MLPs. deepseek_v4: 2 sliding-window layers (window 128), then compressed sparse attention (one entry per 4
positions, an indexer keeping 64) and heavily compressed attention (one per 128) in turn, 16 query heads over one
shared key/value head of 256, four hyper-connection streams, hash-routed MoE in the first 2 layers and
sqrt-softplus routing after (16 experts, top 4, one shared). Workers and timing as bench/decode.py (decode rate =
batch * (N - 1) / (time for N - time for 1), alternated, after a warm-up of the same shapes); greedy tokens are
compared and their agreement printed (random weights leave near-ties that float rounding may break differently).
Then the planner's bytes per sequence at `--context` tokens (one sequence: a window layer keeps its window's pages,
a compressed layer its entries and its buffer of positions not yet pooled, a state layer its state) against the
same model with every token-mixing layer caching each token as its full-attention layers do (DeepSeek-V4: the
shared key/value head, uncompressed, as MLA caches one latent per token).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from decode import Worker  # noqa: E402

COMMON = dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=2,
              head_dim=128, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0)
LAYOUTS = {  # model_type, config, what the table calls it
    "qwen3_5": ("qwen3_5_text", dict(COMMON, num_hidden_layers=8, rms_norm_eps=1e-6, linear_num_key_heads=8,
                                     linear_num_value_heads=16, linear_key_head_dim=64, linear_value_head_dim=64,
                                     full_attention_interval=4), "hybrid Qwen3.5 layout (6 linear + 2 full layers)"),
    "nemotron_h": ("nemotron_h", dict(COMMON, layer_norm_epsilon=1e-5, mamba_num_heads=32, mamba_head_dim=64,
                                      n_groups=8, ssm_state_size=128, conv_kernel=4, chunk_size=128,
                                      layers_block_type=["linear_attention", "mlp", "linear_attention", "mlp",
                                                         "linear_attention", "full_attention", "linear_attention",
                                                         "mlp"]),
                   "Mamba2 NemotronH layout (4 Mamba2 + 1 attention + 3 MLP layers)"),
}
_V4_KINDS = ["sliding_attention"] * 2 + ["compressed_sparse_attention", "heavily_compressed_attention"] * 3
LAYOUTS["deepseek_v4"] = (
    "deepseek_v4", dict(vocab_size=8192, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                        num_key_value_heads=1, head_dim=256, q_lora_rank=512, max_position_embeddings=131072 + 1024,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0, layer_types=_V4_KINDS,
                        mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 6,
                        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
                        sliding_window=128, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
                        moe_intermediate_size=512, o_groups=4, o_lora_rank=256, index_n_heads=8,
                        index_head_dim=64, index_topk=64, hc_mult=4, num_nextn_predict_layers=0),
    "DeepSeek-V4 layout (2 sliding-window + 6 compressed attention layers, 4 hyper-connection streams)")
PROMPT = [1] + [(37 * i + 11) % 8000 + 3 for i in range(31)]


def build(work: Path, layout: str) -> tuple[Path, Path]:
    """The HF folder (random weights, seed 0) and its day0jax conversion."""
    from convert.convert import convert_checkpoint

    hf, ckpt = work / "hf", work / "day0jax"
    model_type, config, _ = LAYOUTS[layout]
    job = [{"op": "tiny_hf", "family": model_type, "config": config, "seed": 0, "out": str(hf)}]
    (work / "jobs.json").write_text(json.dumps(job))
    subprocess.run([str(ROOT / ".venv-ref/bin/python"), str(ROOT / "tests/ref/reference.py"),
                    str(work / "jobs.json")], check=True, stdout=subprocess.DEVNULL)
    convert_checkpoint(hf, ckpt, progress=False)
    return hf, ckpt


def bytes_per_sequence(ckpt: Path, context: int, page_size: int = 16) -> tuple[int, int]:
    """(this model, the same model caching every token of each token-mixing layer as its full-attention layers do):
    float32 bytes of one sequence of `context` tokens."""
    import numpy as np

    from day0jax import models
    from day0jax.core import hf_config
    from sharding.plan import ModelShape, layer_kv_bytes, layer_state_bytes

    config = models.config_from_hf(hf_config.read_config_json(ckpt / "config.json"))
    abstract = models.abstract_model(config)
    shape = ModelShape.from_model(abstract, models.param_infos(abstract), config.max_position_embeddings)
    windows = {kv.window: min(context, -(-kv.window // page_size) * page_size) for kv in shape.kv_layers}
    ours = sum(layer_kv_bytes(x, {}, context, np.float32, windows, page_size) + layer_state_bytes(x, {}, 1)
               for x in shape.cache_layout)
    per_token = shape.kv_layers[-1].token_elements  # a full-attention layer's (a window layer's, uncompressed)
    mixers = sum(x is not None for x in shape.cache_layout)  # NemotronH's MLP layers keep nothing
    return ours, mixers * per_token * 4 * context


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="qwen3_5")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=8192)
    args = ap.parse_args()
    batches, n = [int(b) for b in args.batches.split(",")], args.new_tokens

    with tempfile.TemporaryDirectory() as tmp:
        hf, ckpt = build(Path(tmp), args.layout)
        python = str(ROOT / ".venv/bin/python")
        workers = {"day0jax": Worker([python, "-P", str(ROOT / "bench/decode_worker.py"), str(ckpt)],
                                     {"PYTHONPATH": str(ROOT)}),
                   "transformers": Worker([str(ROOT / ".venv-ref/bin/python"), "-P",
                                           str(ROOT / "bench/decode_reference.py"), str(hf)],
                                          {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})}
        for batch in batches:  # warm-up: every program these shapes use
            for w in workers.values():
                w.ask({"batch": batch, "prompt": PROMPT, "new_tokens": n})
        rates: dict[tuple[str, int], list[float]] = {}
        agree: dict[int, list[float]] = {}
        for _ in range(args.repeats):
            for batch in batches:
                tokens = {}
                for name, w in workers.items():
                    r = w.ask({"batch": batch, "prompt": PROMPT, "new_tokens": n})
                    tokens[name] = r["tokens"]
                    rates.setdefault((name, batch), []).append(batch * (n - 1) / (r["full"] - r["first"]))
                ours, theirs = tokens["day0jax"], tokens["transformers"]
                assert ours[0] == theirs[0], f"first greedy token differs: {ours[0]} vs {theirs[0]}"
                same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
                agree.setdefault(batch, []).append(same / len(ours))
        for w in workers.values():
            w.close()
        ours, full = bytes_per_sequence(ckpt, args.context)

    print(f"\nGreedy decode, {LAYOUTS[args.layout][2]}, hidden 1024, float32, {n} new tokens, "
          f"median of {args.repeats} (tokens/s)\n")
    print("| batch | day0jax | transformers | day0jax / transformers | greedy tokens equal (leading share) |")
    print("|---|---|---|---|---|")
    for batch in batches:
        a, b = (statistics.median(rates[(x, batch)]) for x in ("day0jax", "transformers"))
        print(f"| {batch} | {a:.1f} | {b:.1f} | {a / b:.2f}x | {min(agree[batch]):.2f} |")
    mib = 1 << 20
    print(f"\nPer sequence at {args.context} tokens (float32): {ours / mib:.1f} MiB against {full / mib:.1f} MiB "
          f"with every token-mixing layer caching each token in full ({full / ours:.1f}x); "
          f"{ours / args.context:.0f} against {full / args.context:.0f} bytes per token")


if __name__ == "__main__":
    main()
