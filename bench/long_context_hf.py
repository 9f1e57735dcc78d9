"""The transformers side of bench/long_context.py, in the reference venv: one prompt length in a fresh process.

argv: Hugging Face folder, prompt length, decode tokens, repeats; prints one JSON line. Never imported by day0jax.
"""

import json
import os
import statistics
import sys
import time

import torch


def peak_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmHWM:")) / 1024


def main():
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from transformers import AutoModelForCausalLM

    folder, length, n, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(100, 30000, (1, length), generator=g)

    def prefill():
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
        return time.perf_counter() - t0, out

    def decode(out):
        """n - 1 greedy steps over the prompt's cache (the first token comes from the prefill)."""
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(n - 1):
                out = model(input_ids=token, past_key_values=cache, use_cache=True)
                cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return time.perf_counter() - t0

    decode(prefill()[1])  # warm-up
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    times = []
    for _ in range(repeats):  # each repeat its own cache, dropped before the next
        t, out = prefill()
        times.append((t, decode(out)))
        del out
    first = statistics.median(t for t, _ in times)
    steps = statistics.median(d for _, d in times)
    print(json.dumps({"prefill_tps": length / first, "decode_tps": (n - 1) / steps,
                      "peak_mib": peak_mib()}), file=reply, flush=True)

if __name__ == "__main__":
    main()
