"""day0jax: serve a newly released open-weight language model on any XLA backend, the day it appears.

`day0jax.load(path, dtype=None, mesh=None)` returns a `Model` with `.logits`, `.generate`, `.tokenizer`,
`.config` and `.mesh`. Imported lazily so that `import day0jax` stays cheap and lower layers can import
`day0jax.core.errors` without cycles.
"""

__version__ = "0.1.0"


def __getattr__(name):
    if name == "load":
        from day0jax.loader import load
        return load
    if name == "Model":
        from day0jax.model import Model
        return Model
    raise AttributeError(f"module 'day0jax' has no attribute {name!r}")
