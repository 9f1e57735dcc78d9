"""The transformers side of bench/decode.py: a worker in the reference venv that keeps the model loaded.

One JSON a line: {"batch": B, "prompt": [ids], "new_tokens": N} in; {"full": s, "first": s, "tokens": [...]} out,
the seconds of a greedy `generate` of N tokens and of 1 (so prefill can be taken out). Never imported by day0jax.
"""

import json
import os
import sys
import time

import torch


def main():
    reply = os.fdopen(os.dup(1), "w")  # the protocol owns the real stdout; library output goes to stderr
    os.dup2(2, 1)
    path = sys.argv[1]  # a GGUF file or a Hugging Face folder
    torch.set_num_threads(os.cpu_count() or 1)
    from transformers import AutoModelForCausalLM

    kwargs = {} if os.path.isdir(path) else dict(gguf_file=os.path.basename(path))
    model = AutoModelForCausalLM.from_pretrained(path if os.path.isdir(path) else os.path.dirname(path),
                                                 dtype=torch.float32, **kwargs).eval()

    def run(ids, n):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + n
        return time.perf_counter() - t0, out[0, ids.shape[1]:].tolist()

    print(json.dumps({"ready": True}), file=reply, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        ids = torch.tensor([cmd["prompt"]] * cmd["batch"])
        full, tokens = run(ids, cmd["new_tokens"])
        first, _ = run(ids, 1)
        print(json.dumps({"full": full, "first": first, "tokens": tokens}), file=reply, flush=True)


if __name__ == "__main__":
    main()
