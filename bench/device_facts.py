"""The facts a GPU run's numbers depend on, printed and written as JSON: the device, jax and jaxlib, CUDA and cuDNN,
and the program XLA makes of `ragged_dot` at DeepSeek-V3's MoE shape (a cuDNN fusion, or a dense expansion over
every expert whose scratch memory would not fit beside the model: the figure the MoE op's fallback must respect).

    python bench/device_facts.py [--json PATH] [--cpu-smoke]

`--cpu-smoke` compiles the ragged_dot probe at a tiny shape (the CPU has neither CUDA nor cuDNN).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, no install needed

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kernels_pallas import cases, platform  # noqa: E402


def versions() -> dict[str, Any]:
    import jaxlib

    facts: dict[str, Any] = dict(jax=jax.__version__, jaxlib=jaxlib.__version__, backend=jax.default_backend(),
                                 devices=[str(d) for d in jax.devices()])
    target = platform.current()
    facts.update(device_kind=target.device_kind, cores=target.num_cores, hopper=target.is_hopper)
    try:  # present in CUDA builds of jaxlib only
        from jax._src.lib import cuda_versions
    except ImportError:
        cuda_versions = None
    if cuda_versions is not None:
        for name in ("cuda_runtime_get_version", "cuda_driver_get_version", "cudnn_get_version",
                     "cublas_get_version"):
            try:
                facts[name.removesuffix("_get_version")] = getattr(cuda_versions, name)()
            except Exception as e:  # a library the plugin did not load: say so rather than stop
                facts[name.removesuffix("_get_version")] = f"{type(e).__name__}: {e}"
    return facts


def ragged_dot_program(tiny: bool) -> dict[str, Any]:
    """How XLA compiles `ragged_dot` for this backend at DeepSeek-V3's routed-expert gate/up shape (prefill of
    4096 tokens, 8 experts each): whether a cuDNN call does it, and the scratch bytes it needs."""
    m = dict(next(c for c in cases.flagships()["deepseek-v3"] if c.op == "moe").params)
    G, k, D, F = (8, 2, 128, 128) if tiny else (m["E"], m["k"], m["D"], m["F"])
    M = (16 if tiny else 4096) * k
    lhs = jax.ShapeDtypeStruct((M, D), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((G, D, F), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((G,), jnp.int32)
    compiled = jax.jit(lambda a, b, s: jax.lax.ragged_dot(a, b, s, preferred_element_type=jnp.float32)).lower(
        lhs, rhs, sizes).compile()
    text = compiled.as_text() or ""
    memory = compiled.memory_analysis()
    return dict(shape=f"M={M} G={G} D={D} F={F}", cudnn="cudnn" in text.lower(),
                temp_bytes=getattr(memory, "temp_size_in_bytes", None),
                argument_bytes=getattr(memory, "argument_size_in_bytes", None))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write the facts here")
    p.add_argument("--cpu-smoke", action="store_true", help="the ragged_dot probe at a tiny shape")
    a = p.parse_args(argv)
    facts = versions()
    try:
        facts["ragged_dot"] = ragged_dot_program(a.cpu_smoke)
    except Exception as e:  # the probe is a fact too: that it fails to compile
        facts["ragged_dot"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
    text = json.dumps(facts, indent=1, default=str)
    print(text, flush=True)
    if a.json:
        a.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
