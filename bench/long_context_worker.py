"""The day0jax side of bench/long_context.py: one prompt length in a fresh process; prints one JSON line.

argv: checkpoint, prompt length, decode tokens, repeats. The engine is sized for the prompt (max_model_len = length
+ decode tokens, one sequence); a warm-up of the same calls compiles first, then the peak resident memory is reset.
Prefill is timed on new prompts; decode on the warm one, which the prefix cache holds (see below).
"""

import json
import os
import statistics
import sys
import time


def peak_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmHWM:")) / 1024


def main():
    reply = os.fdopen(os.dup(1), "w")  # library output goes to stderr
    os.dup2(2, 1)
    import numpy as np

    import day0jax
    from day0jax.engine.config import EngineConfig

    ckpt, length, n, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    model = day0jax.load(ckpt, dtype="float32", engine=EngineConfig(max_model_len=length + n, max_num_seqs=1))
    rng = np.random.default_rng(length)
    prompt = rng.integers(100, 30000, length).tolist()

    def timed(k, p):
        t0 = time.perf_counter()
        model.generate([p], k, ignore_eos=True)
        return time.perf_counter() - t0

    timed(n, prompt), timed(1, prompt)  # warm-up: every program these calls use
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    # Prefill: a new prompt each time (the prefix cache cannot help). Decode: the warm prompt again, whose pages the
    # prefix cache holds, so both calls prefill only its last page and the difference is n - 1 decode steps.
    first = statistics.median(timed(1, rng.integers(100, 30000, length).tolist()) for _ in range(repeats))
    timed(1, prompt)  # the new prompts took the pool's pages: cache the warm prompt again
    decode = statistics.median(timed(n, prompt) - timed(1, prompt) for _ in range(repeats))
    print(json.dumps({"prefill_tps": length / first, "decode_tps": (n - 1) / decode,
                      "peak_mib": peak_mib()}), file=reply, flush=True)


if __name__ == "__main__":
    main()
