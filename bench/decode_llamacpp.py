"""The llama.cpp side of bench/decode.py and bench/quant.py: a worker in the reference venv (llama-cpp-python).

    .venv-ref/bin/python bench/decode_llamacpp.py SOURCE.gguf TARGET.gguf [F32|Q8_0] [PROMPT_BATCH]

TARGET is written once from SOURCE unless it is SOURCE: F32 (default) dequantizes every tensor with the `gguf`
package's own dequantization, so llama.cpp runs the very weights day0jax's float32 conversion holds; Q8_0 then
quantizes the source's quantized tensors to Q8_0 blocks with the `gguf` package (float tensors stay as they are).
PROMPT_BATCH (default 512) is how many prompt tokens llama.cpp evaluates per batch: 1 keeps its prompt off the
many-row matrix kernels (its AMX ones crash on some virtual machines) and leaves the decode steps as they are.
Metadata is copied. Protocol as
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


def write_gguf(source: Path, target: Path, type_name: str = "F32") -> None:
    """`source` with its quantized tensors as `type_name` (F32 or Q8_0; float tensors as they are), atomically."""
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
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if type_name == "F32" else gguf.LlamaFileType.MOSTLY_Q8_0)
    for t in reader.tensors:
        # GGUF shapes list the fastest dimension first; numpy arrays the slowest.
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        data = data.reshape(tuple(reversed([int(d) for d in t.shape])))
        floats = t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        if type_name == "Q8_0" and not floats:
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(t.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, data)
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
        write_gguf(source, path, sys.argv[3] if len(sys.argv) > 3 else "F32")
    from llama_cpp import Llama

    threads = os.cpu_count() or 1
    prompt_batch = int(sys.argv[4]) if len(sys.argv) > 4 else 512
    llm = Llama(model_path=str(path), n_ctx=4096, n_batch=prompt_batch, n_ubatch=prompt_batch, n_threads=threads,
                n_threads_batch=threads, verbose=False)

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
