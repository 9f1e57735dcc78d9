"""The llama.cpp side of bench/decode.py: a worker in the reference venv (llama-cpp-python) on an F32 GGUF.

    .venv-ref/bin/python bench/decode_llamacpp.py SOURCE.gguf F32.gguf

The F32 file is written once from SOURCE (every tensor dequantized with the `gguf` package's own dequantization,
metadata copied), so llama.cpp runs the very weights day0jax's float32 conversion holds. Protocol as
bench/decode_reference.py's: {"batch": 1, "prompt": [ids], "new_tokens": N} -> {"full", "first", "tokens"}; batch 1
only. Every generation starts from an empty KV cache (llama-cpp-python would otherwise reuse a matching prefix).
Never imported by day0jax.
"""

import json
import os
import sys
import time
from pathlib import Path

import numpy as np


def write_f32(source: Path, target: Path) -> None:
    """`source` with every tensor as float32 (norms and other F32 tensors as they are), atomically at `target`."""
    import gguf

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    tmp = target.with_suffix(".partial")
    writer = gguf.GGUFWriter(tmp, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue  # the writer sets the header and architecture itself; the file type changes
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        # GGUF shapes list the fastest dimension first; numpy arrays the slowest.
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, data.reshape(tuple(reversed([int(d) for d in t.shape]))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    os.replace(tmp, target)


def main():
    reply = os.fdopen(os.dup(1), "w")  # the protocol owns the real stdout; library output goes to stderr
    os.dup2(2, 1)
    source, path = Path(sys.argv[1]), Path(sys.argv[2])
    if not path.is_file():
        write_f32(source, path)
    from llama_cpp import Llama

    threads = os.cpu_count() or 1
    llm = Llama(model_path=str(path), n_ctx=4096, n_batch=512, n_threads=threads, n_threads_batch=threads,
                verbose=False)

    def run(ids, n):
        llm.reset()
        t0 = time.perf_counter()
        out = []
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            out.append(int(token))
            if len(out) == n:
                break
        return time.perf_counter() - t0, out

    print(json.dumps({"ready": True, "from": f"llama-cpp-python, {path.name}"}), file=reply, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        assert cmd["batch"] == 1, "the llama.cpp worker runs batch 1 only"
        full, tokens = run(cmd["prompt"], cmd["new_tokens"])
        first, _ = run(cmd["prompt"], 1)
        print(json.dumps({"full": full, "first": first, "tokens": tokens}), file=reply, flush=True)


if __name__ == "__main__":
    main()
