"""The bottom of day0jax: what every layer needs and nothing else.

Errors (`errors`), what each layer caches (`cache_layout`), reading HF configs and refusing what is not implemented
(`hf_config`), the HF tensor mapping (`hf_tensors`), the log and progress bars (`logs`), this machine's cache
folders (`paths`). It imports nothing else of this repository, so `sharding`, `convert` and every `day0jax`
sub-package may import it.
"""
