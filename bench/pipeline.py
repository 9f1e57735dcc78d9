"""Pipeline stages on 8 simulated CPU devices: decode throughput and step time for pp=1, 2 and 4 over the same 8
devices, and the bubble fraction (the share of time stages sit idle) of the engine's schedule.

    .venv/bin/python bench/pipeline.py [--meshes tp=8,pp=2;tp=4,pp=4;tp=2] [--rows 8] [--tokens 32] [--repeats 3]

The model: a Llama-architecture decoder with random weights (hidden 512, 16 layers, 8 query and 2 kv heads of 64,
MLP 1536, 8k vocabulary), float32, written once into the bench cache. Each mesh loads it in one worker process with 8
simulated devices and decodes `rows` prompts of 32 tokens together, greedy; after a warm-up of the same call the
best of `repeats` gives the decode step time, (time of N tokens - time of 1) / (N - 1), and tokens/s.

Simulated devices share this machine's cores, so stages on different devices do not really run side by side and
the wall-clock figures cannot show what a pipeline gains. The bubble is therefore computed from the schedule: each
stage's program time on one micro-batch and each move between stages are measured alone (`stage_seconds`, the
fastest of 7 runs), then the engine's dispatch order is replayed for 64 decode steps: each device runs its
programs in the order the host dispatched them (step by step, micro-batch by micro-batch), a program starts when
its device is free and its input has arrived. Bubble = 1 - busy time / (stages x makespan). Two rules for when a
micro-batch's next step may start:
- per micro-batch (the engine): when its own tokens are back on the first stage (greedy tokens from the last
  stage, sampled ones from the micro-batch's own sampler call);
- whole batch: when every micro-batch's are (a fill and a drain every step: what a step costs whose rows changed).
The bubble has two causes, stages of unequal time and the schedule itself; "equal stages" replays the schedule
with every stage at their mean time. The layers are split by what a decode step reads (`sharding.pipeline`): each
layer's parameters and KV pool, and the vocabulary projection on the last stage.
The modelled tokens/s is rows / the schedule's steady step time, as if each stage had its own device.
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
CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=8192, hidden_size=512,
              intermediate_size=1536, num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=2,
              max_position_embeddings=1024, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, rope_theta=10000.0)
DEVICES = 8
STEPS = 64  # decode steps replayed per schedule


def checkpoint() -> Path:
    """The bench model's day0jax checkpoint, written into the bench cache on first use."""
    from safetensors.numpy import save_file

    from convert.convert import Options, convert_checkpoint
    from day0jax.core.paths import cache_root

    root = cache_root() / "bench" / "pipeline"
    hf, ckpt = root / "hf", root / "day0jax"
    config = hf / "config.json"
    if not config.is_file() or json.loads(config.read_text()) != CONFIG:  # none yet, or of another shape
        (ckpt / "day0jax.json").unlink(missing_ok=True)
        (hf / "model.safetensors").unlink(missing_ok=True)
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
    return ckpt


def schedule(stage: list[float], moves: list[float], micro: int, routed: bool, steps: int = STEPS) -> dict:
    """Replays `steps` decode steps of `micro` micro-batches through stages taking `stage[s]` seconds each, with
    `moves[s]` seconds to reach stage s + 1 (the tokens' way back to the first stage costs the last move); `routed`:
    a micro-batch's next step waits for its own tokens only, else for the whole batch's.

    Returns:
        {"bubble": idle share, "step_seconds": steady step time (the second half of the steps)}.
    """
    pp = len(stage)
    back = moves[-1] if moves else 0.0
    free = [0.0] * pp
    end: dict[tuple[int, int, int], float] = {}
    busy = 0.0
    step_ends = []
    for k in range(steps):
        for j in range(micro):
            for s in range(pp):
                if s > 0:
                    ready = end[k, s - 1, j] + moves[s - 1]
                elif k == 0:
                    ready = 0.0
                elif routed:
                    ready = end[k - 1, pp - 1, j] + back
                else:
                    ready = max(end[k - 1, pp - 1, m] for m in range(micro)) + back
                start = max(free[s], ready)
                end[k, s, j] = free[s] = start + stage[s]
                busy += stage[s]
        step_ends.append(max(end[k, pp - 1, m] for m in range(micro)))
    makespan = step_ends[-1]
    half = steps // 2
    return {"bubble": 1 - busy / (pp * makespan),
            "step_seconds": (step_ends[-1] - step_ends[half - 1]) / (steps - half)}


def worker(ckpt: str, spec: str, rows: int, tokens: int, repeats: int) -> dict:
    import time

    import day0jax
    from day0jax.engine.config import EngineConfig
    from day0jax.engine.stages import stage_seconds

    model = day0jax.load(ckpt, mesh=spec, engine=EngineConfig(max_model_len=256, max_num_seqs=rows))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, CONFIG["vocab_size"], 32).tolist() for _ in range(rows)]

    def timed(n):
        t0 = time.perf_counter()
        model.generate(prompts, n, ignore_eos=True)
        return time.perf_counter() - t0

    timed(tokens), timed(1)  # warm-up: compiles every program these calls take
    step = min((timed(tokens) - timed(1)) / (tokens - 1) for _ in range(repeats))
    out = {"mesh": spec, "step_seconds": step, "tokens_per_s": rows / step}
    runner = model.engine.runner
    if runner.micro is not None:
        width = model.engine.layout.decode_widths[0]
        out["micro"] = {}
        for micro in sorted({1, 2, 4, runner.stages.count}):
            runner.micro.most = micro
            stage, moves = stage_seconds(runner, (rows, 1, width), repeats=7)
            equal = [sum(stage) / len(stage)] * len(stage)
            m = runner.micro.count(rows)
            out["micro"][micro] = {"stage": stage, "moves": moves,
                                   "routed": schedule(stage, moves, m, routed=True),
                                   "whole": schedule(stage, moves, m, routed=False),
                                   "equal_routed": schedule(equal, moves, m, routed=True),
                                   "equal_whole": schedule(equal, moves, m, routed=False)}
        out["layers"] = runner.stages.describe().replace(" | ", " / ")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--meshes", default="tp=8;pp=2,tp=4;pp=4,tp=2", help="';'-separated mesh specs")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(str(checkpoint()), args.worker, args.rows, args.tokens, args.repeats)), flush=True)
        return
    import platform

    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}")
    checkpoint()
    results = []
    for spec in args.meshes.split(";"):
        proc = subprocess.run([sys.executable, __file__, "--worker", spec, "--rows", str(args.rows), "--tokens",
                               str(args.tokens), "--repeats", str(args.repeats)], env=env, capture_output=True,
                              text=True, check=False)
        if proc.returncode:
            sys.exit(f"{spec} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"{CONFIG['num_hidden_layers']}-layer llama (hidden {CONFIG['hidden_size']}), {DEVICES} simulated devices "
          f"on {cpu} ({os.cpu_count()} cores), batch {args.rows}, float32\n")
    base = results[0]["tokens_per_s"]
    print("| mesh | layers per stage | step ms (wall) | tokens/s (wall) | ratio |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['mesh']} | {r.get('layers', 'all')} | {1e3 * r['step_seconds']:.1f} | {r['tokens_per_s']:.0f} | "
              f"{r['tokens_per_s'] / base:.2f}x |")
    print("\nSchedule from measured stage times (bubble = idle share of the stages; modelled tokens/s with each "
          "stage on its own device):\n")
    print("| mesh | micro-batches | stage ms | move ms | bubble, per micro-batch | bubble, whole batch | "
          "equal stages: per micro-batch, whole | modelled tokens/s |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: |")
    for r in results:
        for micro, m in sorted(r.get("micro", {}).items(), key=lambda kv: int(kv[0])):
            stage = " / ".join(f"{1e3 * t:.2f}" for t in m["stage"])
            moves = " / ".join(f"{1e3 * t:.2f}" for t in m["moves"])
            print(f"| {r['mesh']} | {micro} | {stage} | {moves} | {100 * m['routed']['bubble']:.0f}% | "
                  f"{100 * m['whole']['bubble']:.0f}% | {100 * m['equal_routed']['bubble']:.0f}%, "
                  f"{100 * m['equal_whole']['bubble']:.0f}% | {args.rows / m['routed']['step_seconds']:.0f} |")


if __name__ == "__main__":
    main()
