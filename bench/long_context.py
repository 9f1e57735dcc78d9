"""Long prompts on a small model: time to first token (prefill tokens/s) and peak memory for 1k to 32k-token prompts,
and decode tokens/s at those context lengths, day0jax beside transformers.

    .venv/bin/python bench/long_context.py [--lengths 1024,4096,16384,32768] [--repeats 2] [--decode-tokens 16]
                                           [--transformers-max 32768]

The model: a Llama-architecture decoder with random weights (hidden 512, 4 layers, 8 query and 2 kv heads of 64,
MLP 1536, 32k vocabulary, a 32k context by `llama3` RoPE scaling of a 4k one), written once as a Hugging Face
folder (bench cache) and converted; both systems hold the same weights in float32. Every (system, length) runs in a
fresh worker process, so its peak is that length's: day0jax with the engine sized for it (max_model_len = prompt +
decode tokens, one sequence), transformers with its default attention. A warm-up of the same length comes first
(compilation); then the peak resident memory (VmHWM) is reset and the timed calls run: prefill = a 1-token
generate, decode rate = (N - 1) / (time for N tokens - time for 1). Peak memory is fitted as a + b * length by
least squares over the lengths (linear if the fit's residuals are small against the growth).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=32000, hidden_size=512,
              intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
              max_position_embeddings=32768 + 1024, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False,
              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 4096}, rope_theta=500000.0)


def model_folders() -> tuple[Path, Path]:
    """(Hugging Face folder, day0jax checkpoint) of the bench model, written into the bench cache on first use."""
    from safetensors.numpy import save_file

    from convert.convert import Options, convert_checkpoint
    from day0jax.core.paths import cache_root

    root = cache_root() / "bench" / "long-context"
    hf, ckpt = root / "hf", root / "day0jax"
    if not (hf / "model.safetensors").is_file():
        hf.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        D, F, V, H = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"], 64
        N, K = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"]
        dense = lambda o, i: (rng.standard_normal((o, i), np.float32) / np.sqrt(i)).astype(np.float32)  # noqa: E731
        t = {"model.embed_tokens.weight": rng.standard_normal((V, D), np.float32),
             "model.norm.weight": np.ones(D, np.float32), "lm_head.weight": dense(V, D)}
        for i in range(CONFIG["num_hidden_layers"]):
            p = f"model.layers.{i}."
            t.update({p + "input_layernorm.weight": np.ones(D, np.float32),
                      p + "post_attention_layernorm.weight": np.ones(D, np.float32),
                      p + "self_attn.q_proj.weight": dense(N * H, D), p + "self_attn.k_proj.weight": dense(K * H, D),
                      p + "self_attn.v_proj.weight": dense(K * H, D), p + "self_attn.o_proj.weight": dense(D, N * H),
                      p + "mlp.gate_proj.weight": dense(F, D), p + "mlp.up_proj.weight": dense(F, D),
                      p + "mlp.down_proj.weight": dense(D, F)})
        save_file(t, str(hf / "model.safetensors"))
        (hf / "config.json").write_text(json.dumps(CONFIG))
    if not (ckpt / "day0jax.json").is_file():
        convert_checkpoint(hf, ckpt, force=ckpt.exists(), progress=False, options=Options(dtype="float32"))
    return hf, ckpt


def run_worker(system: str, folder: Path, length: int, decode_tokens: int, repeats: int) -> dict:
    """One fresh worker process for (system, length): its JSON result, or {'error': ...}."""
    if system == "day0jax":
        cmd = [str(ROOT / ".venv/bin/python"), "-P", str(ROOT / "bench/long_context_worker.py")]
        env = {"PYTHONPATH": str(ROOT)}
    else:
        cmd = [str(ROOT / ".venv-ref/bin/python"), "-P", str(ROOT / "bench/long_context_hf.py")]
        env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(cmd + [str(folder), str(length), str(decode_tokens), str(repeats)], capture_output=True,
                          text=True, env={**os.environ, **env})
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    return json.loads(lines[-1])


def linear_fit(xs: list[int], ys: list[float]) -> tuple[float, float, float]:
    """(intercept, slope, largest residual as a share of the growth over the range) of ys ~ a + b * xs."""
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    residual = max(abs(y - (a + b * x)) for x, y in zip(xs, ys))
    growth = abs(b) * (max(xs) - min(xs)) or 1.0
    return a, b, residual / growth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,4096,16384,32768")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--transformers-max", type=int, default=32768, help="longest prompt given to transformers")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    hf, ckpt = model_folders()
    results: dict[str, dict[int, dict]] = {"day0jax": {}, "transformers": {}}
    for length in lengths:
        results["day0jax"][length] = run_worker("day0jax", ckpt, length, args.decode_tokens, args.repeats)
        if length <= args.transformers_max:
            results["transformers"][length] = run_worker("transformers", hf, length, args.decode_tokens,
                                                         args.repeats)
        print(json.dumps({"length": length, **{k: v.get(length) for k, v in results.items()}}), file=sys.stderr,
              flush=True)

    def cell(r: dict | None, key: str, fmt: str) -> str:
        if r is None:
            return "-"
        return f"error: {r['error']}" if "error" in r else format(r[key], fmt)

    print(f"\nLong prompts, {CONFIG['num_hidden_layers']}-layer {CONFIG['hidden_size']}-wide Llama (random weights), "
          f"float32, batch 1, median of {args.repeats}\n")
    print("| prompt tokens | day0jax prefill tok/s | transformers prefill tok/s | day0jax decode tok/s | "
          "transformers decode tok/s | day0jax peak MiB | transformers peak MiB |")
    print("|---|---|---|---|---|---|---|")
    for length in lengths:
        d, t = results["day0jax"][length], results["transformers"].get(length)
        print(f"| {length} | {cell(d, 'prefill_tps', '.0f')} | {cell(t, 'prefill_tps', '.0f')} | "
              f"{cell(d, 'decode_tps', '.1f')} | {cell(t, 'decode_tps', '.1f')} | {cell(d, 'peak_mib', '.0f')} | "
              f"{cell(t, 'peak_mib', '.0f')} |")
    for system, per in results.items():
        ok = [(n, r["peak_mib"]) for n, r in per.items() if r and "error" not in r]
        if len(ok) >= 3:
            a, b, worst = linear_fit([n for n, _ in ok], [m for _, m in ok])
            print(f"\n{system}: peak MiB ~ {a:.0f} + {b * 1024:.1f} per 1k tokens; largest residual "
                  f"{worst:.1%} of the growth over {ok[0][0]}-{ok[-1][0]} tokens")


if __name__ == "__main__":
    main()
