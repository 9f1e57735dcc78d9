"""The engine: KV caches, jitted prefill and decode steps, sampling. It speaks token ids only."""
