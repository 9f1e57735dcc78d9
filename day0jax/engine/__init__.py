"""The one engine: requests in, token ids out, over a paged KV cache. It speaks token ids only.

`engine.Engine` runs the step loop that `Model.generate` and the server both drive; `scheduler` admits and plans rows
(prefix reuse: `block_pool`); `runner` is the device side (page pools: `paged_cache`); `sampling` the sampler;
`config` the `EngineConfig` and its `EngineLayout`; `requests` the request types; `async_engine` its asyncio face.
"""
