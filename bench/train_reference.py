"""The transformers + PEFT side of bench/train.py: a worker in the reference venv that keeps the model loaded.

argv: the GGUF file, the batches (.npy int32 [steps, B, T]), the initial PEFT adapter folder, the learning rate.
Loads the GGUF in float32 (its blocks dequantized), the adapter trainable on top, AdamW (no weight decay); answers
{"steps": n} with {"seconds": [...]} for the next n batches, the last answer also with every step's loss and the
peak resident MiB. Never imported by day0jax.
"""

import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.long_context_worker import peak_mib  # noqa: E402


def main():
    reply = os.fdopen(os.dup(1), "w")  # the protocol owns the real stdout; library output goes to stderr
    os.dup2(2, 1)
    gguf, tokens_path, adapter, lr = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    torch.set_num_threads(os.cpu_count() or 1)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter, is_trainable=True)
    model.train()
    tokens = torch.from_numpy(np.load(tokens_path)).long()
    with torch.no_grad():
        initial = model(input_ids=tokens[0], labels=tokens[0]).loss.item()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    print(json.dumps({"ready": True, "initial_loss": initial, "trainable": sum(p.numel() for p in params)}),
          file=reply, flush=True)
    losses = []
    for line in sys.stdin:
        seconds = []
        for _ in range(json.loads(line)["steps"]):
            ids = tokens[len(losses)]
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss  # labels shifted inside: every next token counts
            loss.backward()
            opt.step()
            losses.append(loss.item())
            seconds.append(time.perf_counter() - t0)
        extra = {"losses": losses, "peak_mib": peak_mib()} if len(losses) == len(tokens) else {}
        print(json.dumps({"seconds": seconds, **extra}), file=reply, flush=True)


if __name__ == "__main__":
    main()
