"""The one engine: requests in, token ids out, over a paged KV cache. It speaks token ids only.

- `requests`: `SamplingParams`, `TokenEvent`, the per-sequence state, the request errors;
- `config`: `EngineConfig` (runtime choices) and the `EngineLayout` it resolves to (pool size, shape buckets);
- `scheduler`: admission, decode rows and prefill chunks, preemption, prefix reuse (`block_pool`);
- `engine`: the step loop (`Engine`), which `Model.generate` and the server both drive;
- `runner`: the device side (parameters, page pools in `paged_cache`, the forward and sample programs);
- `sampling`: the sampler;
- `async_engine`: the engine on its own thread, with an asyncio face for the server.
"""
