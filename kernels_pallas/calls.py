"""`OpCall`: one kind of call a model makes to an operator, with the static facts that fix its shapes.

Layers report them in `op_calls()` (docs/adding_a_kernel.md). Parameters by op (N query heads, K kv heads, H key
head dim, D hidden, E experts, F expert or MLP width, k experts per token):
- attention, paged_attention: N, K, H, Hv (value head dim), scale (None: H ** -0.5), window, softcap, sinks
  (bool), latent (bool: multi-head latent attention in its absorbed form); chunk (chunked local attention: a query
  sees its own chunk of positions; reported only where set);
- moe (the grouped matmul of routed experts): E, k, D, F, routing; quantized (the experts' storage, 'int4/32': reported
  only for quantized experts);
- rms_norm: D, eps, offset (1.0 for Gemma-style 1 + w);
- gated_delta_rule (linear attention): Nk query/key heads, Nv value heads, Hk key and Hv value head dims, decay
  ('head': one log decay per value head, Qwen3-Next; 'channel': one per key channel, Kimi Linear);
- sparse_attention (indexed, DeepSeek-V3.2): N, K, H, Hv, scale, latent as attention; topk keys per query, I
  indexer heads of Di dims, indexer (False: the layer reuses an earlier layer's top-k);
- quantized_linear (a linear map whose weight stays quantized): O outputs, I inputs, kind ('int8', 'int4', 'fp8'),
  group (inputs per scale), offset (bool), scale_dtype;
- mlp, rope, causal_conv1d, vision_attention (`PLAIN_OPS`): plain jax.numpy, no kernel; listed so the report shows
  every operator a layer runs. causal_conv1d: C channels, W kernel width; act (reported only where it is not SiLU:
  None for LFM's convolution, which has none). vision_attention: a vision tower's bidirectional attention, N heads x
  H over T tokens per image (None: as many as the image has patches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PLAIN_OPS = ("mlp", "rope", "causal_conv1d", "vision_attention")


@dataclass(frozen=True)
class OpCall:
    """An op name and its parameters (sorted (name, value) pairs, so calls compare and hash by value)."""

    op: str
    params: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, op: str, **params: Any) -> "OpCall":
        return cls(op, tuple(sorted(params.items())))

    def __getitem__(self, name: str) -> Any:
        return dict(self.params)[name]

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.params).get(name, default)

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, **dict(self.params)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "OpCall":
        d = dict(d)
        return cls.of(d.pop("op"), **d)

    def describe(self) -> str:
        """The variant in words, e.g. 'GQA 32q/8kv heads x 128, sliding window 4096'."""
        p = dict(self.params)
        if self.op in ("attention", "paged_attention"):
            N, K, H, Hv = p["N"], p["K"], p["H"], p["Hv"]
            kind = "MHA" if N == K else "MQA" if K == 1 else "GQA"
            head = f"x {H}" if H == Hv else f"x {H} (values {Hv})"
            parts = [f"{'MLA (absorbed): ' if p.get('latent') else ''}{kind} {N}q/{K}kv heads {head}"]
            if p.get("window") is not None:
                parts.append(f"sliding window {p['window']}")
            if p.get("chunk") is not None:
                parts.append(f"chunked local attention {p['chunk']}")
            if p.get("softcap") is not None:
                parts.append(f"score soft-cap {p['softcap']}")
            if p.get("sinks"):
                parts.append("sinks")
            if p.get("gate"):
                parts.append(f"output gate ({p['gate']})")
            if p.get("scale") is not None:
                parts.append(f"scale {p['scale']:.4g}")
            return ", ".join(parts)
        if self.op == "moe":
            shared = f", shared {p['shared']}" if p.get("shared") else ""
            quantized = f", {p['quantized']} weights" if p.get("quantized") else ""
            return f"MoE {p['E']} experts x {p['F']}, top-{p['k']} {p['routing']}{shared}{quantized}"
        if self.op == "quantized_linear":
            offset = " with offsets" if p["offset"] else ""
            return (f"{p['kind']} weights [{p['O']} x {p['I']}], groups of {p['group']}{offset} "
                    f"({p['scale_dtype']} scales)")
        if self.op == "rms_norm":
            return f"RMSNorm over {p['D']}, eps {p['eps']:g}{' (1 + w)' if p['offset'] else ''}"
        if self.op == "gated_delta_rule":
            Nk, Nv, Hk, Hv = p["Nk"], p["Nv"], p["Hk"], p["Hv"]
            head = f"x {Hk}" if Hk == Hv else f"x {Hk} (values {Hv})"
            decay = "per-channel decay" if p["decay"] == "channel" else "per-head decay"
            return f"gated delta rule {Nk}qk/{Nv}v heads {head}, {decay}"
        if self.op == "sparse_attention":
            source = f"a {p['I']}-head indexer x {p['Di']}" if p.get("indexer") else "an earlier layer's indexer"
            return (f"{'MLA (absorbed): ' if p.get('latent') else ''}{p['N']}q/{p['K']}kv heads x {p['H']} over the "
                    f"top-{p['topk']} keys of {source}")
        if self.op == "causal_conv1d":
            act = "SiLU" if p.get("act", "silu") == "silu" else "no activation"
            return f"depthwise causal conv1d over {p['C']} channels, width {p['W']}, {act}"
        if self.op == "vision_attention":
            return f"bidirectional MHA {p['N']} heads x {p['H']} over {p['T']} tokens per image"
        if self.op == "mlp":
            return f"{'gated ' if p.get('gated', True) else ''}MLP x {p['F']} ({p['act']})"
        if self.op == "rope":
            if p.get("kind") is None:
                return "none (NoPE layer)"
            factor = f", factor {p['factor']:g}" if p.get("factor") else ""
            part = f", {p['rotary_dim']} of {p['head_dim']} dims" if p["rotary_dim"] != p["head_dim"] else ""
            return f"{p['kind']} (theta {p['theta']:g}{factor}{part})"
        return ", ".join(f"{k}={v}" for k, v in self.params)
