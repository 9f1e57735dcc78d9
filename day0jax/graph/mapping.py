"""What day0jax has for a traced `transformers` module class or torch function.

A module class maps to an operator of the pool (its `OpSpec.torch_patterns`), a layer of `day0jax/layers/` or the
model structure (`LAYERS` below), a plain torch building block (`PLAIN_MODULES`), or nothing: MISSING. Patterns match
a class's role (its name less the model's prefix) or its full name, so a family's 'Glm5NextTextRMSNorm' is an
RMSNorm while its 'Glm5NextTextLinearAttention' is not an 'Attention'.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from kernels_pallas import ops

# Building blocks that are not operators: where day0jax writes them, and the class patterns they cover.
LAYERS = (
    ("decoder layer", "day0jax/layers/decoder.py", ("*DecoderLayer", "Block")),  # any mixer's wrapper
    ("model", "day0jax/models/", ("Model", "TextModel", "ForCausalLM", "ForConditionalGeneration")),
    ("embedding", "day0jax/layers/linear.py", ("Embedding", "ScaledWordEmbedding", "TextScaledWordEmbedding")),
    ("layer norm", "day0jax/layers/norms.py", ("LayerNorm",)),
    ("softmax scaling", "day0jax/layers/mla.py", ("SoftmaxScaling",)),
)

# torch's own modules that carry no mechanism of their own (activations, containers, dropout): plain jax.numpy.
PLAIN_MODULES = ("*Activation", "GELUTanh", "SiLU", "GELU", "ReLU", "Tanh", "Sigmoid", "Softplus", "Identity",
                 "Dropout", "ModuleList", "ModuleDict", "Sequential", "ParameterList")

# torch functions a jax.numpy expression writes directly: elementwise math, shapes, small reductions, indexing.
PLAIN_FUNCTIONS = frozenset("""
__and__ __or__ __xor__ __invert__ __eq__ __ne__ __lt__ __le__ __gt__ __ge__ __floordiv__ __mod__ __neg__ __setitem__
__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __pow__ __rpow__ __matmul__
_set_grad_enabled numel item remainder fmod is_floating_point dim size abs add add_ addmm all amax amin any arange
argmax argmin argsort baddbmm bmm bool broadcast_to cat
ceil chunk clamp clamp_ clamp_min clip clone contiguous copy_ cos cumprod cumsum detach diag diagonal div div_ double
dropout einsum elu embedding empty empty_like eq exp exp_ expand expand_as exp2 eye flatten flip float floor full
full_like gather ge gelu gt half histc index_add index_add_ index_copy index_fill index_put index_select int isinf
isnan l2_norm layer_norm le leaky_relu lerp log log1p log_softmax logsigmoid long lt masked_fill masked_fill_
masked_scatter matmul max maximum mean min minimum mm mul mul_ nan_to_num narrow ne neg new_empty new_full new_ones
new_tensor new_zeros nonzero norm normalize ones ones_like outer pad permute polar pow prod reciprocal relu relu_
repeat repeat_interleave reshape round rsqrt scatter scatter_ scatter_add scatter_add_ select sigmoid sign silu sin
softmax softplus sort split sqrt square squeeze stack std sub sub_ sum t tanh tensor tensor_split tile to topk
transpose tril triu type type_as unbind unflatten unique unsqueeze var view view_as view_as_complex view_as_real where
zero_ zeros zeros_like
""".split())


@dataclass(frozen=True)
class Mapped:
    """What day0jax has for one module class or torch function."""

    kind: str  # "operator", "layer", "plain" or "missing"
    name: str  # the operator's or layer's name; the class or function itself where plain or missing
    where: str = ""  # a layer's file

    @property
    def covered(self) -> bool:
        return self.kind != "missing"


def role(class_name: str, prefixes: list[str]) -> str:
    """The class name less the longest of the model's prefixes it starts with ('Qwen3MoeSparseMoeBlock' ->
    'SparseMoeBlock'); the name itself where none fits."""
    for prefix in sorted(prefixes, key=len, reverse=True):
        if class_name.startswith(prefix) and len(class_name) > len(prefix):
            return class_name[len(prefix):]
    return class_name


def _matches(patterns, class_name: str, class_role: str) -> bool:
    return any(not p.startswith("fn:") and (fnmatch.fnmatchcase(class_role, p) or fnmatch.fnmatchcase(class_name, p))
               for p in patterns)


def module(class_name: str, prefixes: list[str]) -> Mapped:
    """What day0jax has for module class `class_name` of a model whose classes start with `prefixes`."""
    r = role(class_name, prefixes)
    for spec in ops.specs().values():
        if _matches(spec.torch_patterns, class_name, r):
            return Mapped("operator", spec.name)
    for name, where, patterns in LAYERS:
        if _matches(patterns, class_name, r):
            return Mapped("layer", name, where)
    if _matches(PLAIN_MODULES, class_name, class_name):
        return Mapped("plain", class_name)
    return Mapped("missing", class_name)


def function(name: str) -> Mapped:
    """What day0jax has for torch function `name` called directly in a module's forward."""
    for spec in ops.specs().values():
        if any(fnmatch.fnmatchcase(f"fn:{name}", p) for p in spec.torch_patterns):
            return Mapped("operator", spec.name)
    if name in PLAIN_FUNCTIONS:
        return Mapped("plain", name)
    return Mapped("missing", name)
