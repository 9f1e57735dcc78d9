"""The engine: KV caches, jitted prefill and decode steps, sampling. It speaks token ids only.

`generator.Generator` (contiguous cache) is `Model.generate`'s path; `engine.Engine` is the serving engine
(paged cache in `paged_cache`, page accounting and prefix cache in `block_pool`, device programs in `runner`,
continuous batching with chunked prefill and preemption), `async_engine.AsyncEngine` runs it on a thread for the
server.
"""
