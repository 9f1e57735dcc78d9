"""The transformers side of bench/serve.py: a worker in the reference venv that keeps the model loaded.

argv: the GGUF path. One JSON command a line on stdin, one JSON answer a line on stdout:
- {"op": "batch", "prompts": [[ids]...], "outputs": [n...]} -> {"seconds"} of one left-padded `generate` batch
  (everyone runs to the longest output);
- {"op": "decode", "batch": B, "prompt": [ids], "tokens": N} -> {"tokens_per_s"} of decode alone (N new tokens
  minus a run of 1). Never imported by day0jax.
"""

import json
import os
import sys
import time

# bench/ holds scripts named like packages transformers probes for (kernels.py): keep them off the import path.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402


def main():
    torch.set_num_threads(os.cpu_count() or 1)
    from transformers import AutoModelForCausalLM

    gguf = sys.argv[1]
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                 dtype=torch.float32).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def generate(prompts, new_tokens):
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding, as for generation
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
        assert out.shape[1] == width + new_tokens
        return time.perf_counter() - t0

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "batch":
            answer = {"seconds": generate(cmd["prompts"], max(cmd["outputs"]))}
        else:
            prompts, n = [cmd["prompt"]] * cmd["batch"], cmd["tokens"]
            full, first = generate(prompts, n), generate(prompts, 1)
            answer = {"tokens_per_s": cmd["batch"] * (n - 1) / (full - first)}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
