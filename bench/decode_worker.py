"""The day0jax side of bench/decode.py: a worker that keeps one checkpoint loaded and answers timing commands.

It imports the first `day0jax` on PYTHONPATH, so it runs this tree or an earlier revision's (`--baseline DIR`),
using only what every revision has: `day0jax.load(path[, dtype=...])` and `Model.generate(prompts, n,
ignore_eos=True)`.
Protocol as bench/decode_reference.py's.
"""

import json
import os
import sys
import time


def main():
    reply = os.fdopen(os.dup(1), "w")  # the protocol owns the real stdout; library output goes to stderr
    os.dup2(2, 1)
    import day0jax

    # An optional dtype (bfloat16: the CPU default only where it is faster at equal greedy output).
    model = day0jax.load(sys.argv[1], **({"dtype": sys.argv[2]} if len(sys.argv) > 2 else {}))

    def run(prompts, n):
        t0 = time.perf_counter()
        out = model.generate(prompts, n, ignore_eos=True)
        return time.perf_counter() - t0, out[0]

    import jax
    from flax import nnx

    param_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model.module, nnx.Param)))
    print(json.dumps({"ready": True, "from": os.path.dirname(os.path.dirname(day0jax.__file__)),
                      "param_bytes": param_bytes}), file=reply, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        prompts = [cmd["prompt"]] * cmd["batch"]
        full, tokens = run(prompts, cmd["new_tokens"])
        first, _ = run(prompts, 1)
        print(json.dumps({"full": full, "first": first, "tokens": tokens}), file=reply, flush=True)


if __name__ == "__main__":
    main()
