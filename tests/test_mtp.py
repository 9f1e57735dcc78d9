"""Multi-token-prediction (MTP) layers: speculative decoding with a model's own MTP layers (DeepSeek-V3 style, stored as
layers after the last one, also DeepSeek-V3.2's and GLM-5's sparse-attention ones with an indexer of their own;
Qwen3-Next / Qwen3.5 style, `mtp.*`; ERNIE 4.5 MoE's, Step-3.7's and MiMo-V2-Flash's, transformers' generic MTP
layers, chained after their post-norm; Nemotron 3's, blocks of a pattern between the projection and a final norm,
beside Mamba2 layers; DeepSeek-V4's, over the hyper-connected streams, beside compressed attention; HY-V3's, stored
as DeepSeek-V3's with a final norm of its own; HY-V4's, a decoder layer without the model's hyper-connections;
MiniMax-M3's, a block-sparse MoE layer whatever the model's per-layer lists say). Greedy tokens equal plain
decoding's; the drafts the engine reads after each step are the MTP chain's over the verified tokens (each layer's KV
pages caught up over every kept token, as transformers' `MtpModel` chains its layers, and rewritten where a drafted
token had reached them); conversion keeps the layers (`--no-mtp` drops them) as an optional part of the checkpoint
that `check` lists and `load` reads only for speculative method "mtp"; MiniMax-M2's, whose forward nothing public
defines, and Mistral Large 4's and Qwen4-Exp's, not implemented, are refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from day0jax import models
from day0jax.engine.config import EngineConfig, SpeculativeConfig
from day0jax.engine.engine import Engine
from families import FAMILIES
from sharding.mesh import make_mesh
from test_deepseek_v4_ops import CONFIG as V4_OPS_CONFIG
from test_engine_paged import PROMPTS, cache_less_greedy, greedy
from test_speculative import QWEN3_NEXT, Oracle, collect

CONTEXT = 128
# Layer 0 dense, layer 1 MoE; the MTP layer (index 2) is an MoE layer, as in DeepSeek-V3.
DEEPSEEK = dict(model_type="deepseek_v3", vocab_size=256, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=16,
                qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_group=2, topk_group=1,
                first_k_dense_replace=1, max_position_embeddings=CONTEXT, num_nextn_predict_layers=1)
# Sparse attention: the MTP layer has an indexer of its own (its keys cached in index pages, as the main layers');
# top-8 keys per query, so the longer sequences attend over a subset. 16 indexer heads to avoid relu ties.
DEEPSEEK_V32 = dict(DEEPSEEK, model_type="deepseek_v32", n_shared_experts=1, index_topk=8, index_head_dim=16,
                    index_n_heads=16)
# GLM-5: layer 1 is "shared" (it attends over layer 0's top-k); the MTP layer has its own indexer.
GLM_MOE_DSA = dict(DEEPSEEK_V32, model_type="glm_moe_dsa", n_group=1, topk_group=1, index_topk_freq=2)
QWEN3_5 = dict(model_type="qwen3_5_text", vocab_size=256, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=CONTEXT, layer_types=["linear_attention", "full_attention"],
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
               mtp_num_hidden_layers=1)

# ERNIE 4.5 MoE: transformers' generic MTP layer (its post-norm the model's final norm), its decoder layer built as
# layer 0 is: an MoE here (start index 0), with shared experts, biases and the routing bias; lm_head has a bias.
ERNIE = dict(model_type="ernie4_5_moe", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=CONTEXT,
             moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=2, moe_layer_start_index=0,
             use_bias=True, tie_word_embeddings=False, rope_theta=100.0, num_nextn_predict_layers=1)
# Step-3.7 (tests/families.py's, sliding layer 1 with more heads than the full ones): two MTP layers, their kinds given
# by the per-layer lists' trailing entries as StepFun's configs give them, full attention (num_attention_heads), the
# first an MoE, the second dense, each with the clamps of the main layer of its index (biting), and a post-norm of
# its own; the second is chained on the first's output after that norm.
_STEP = FAMILIES["step3p7"][1]
STEP3P7 = dict(_STEP, model_type="step3p7", text_config=dict(
    _STEP["text_config"], num_nextn_predict_layers=2, swiglu_limits=[0.7, 0.5, 0.8],
    layer_types=[*_STEP["text_config"]["layer_types"], "full_attention", "full_attention"],
    mlp_layer_types=[*_STEP["text_config"]["mlp_layer_types"], "sparse", "dense"]))
# MiMo-V2-Flash (tests/families.py's: full, sliding, sliding; window 8, sinks, value scale, partial RoPE per kind):
# transformers' generic MTP layer under Xiaomi's names, its decoder layer a sliding-attention one (window 8, so the
# longer prompts' window bites) with a dense MLP and a post-norm of its own; two layers, the second chained.
MIMO = dict(FAMILIES["mimo_v2_flash"][1], model_type="mimo_v2_flash", num_nextn_predict_layers=2)

# Nemotron 3 (tests/families.py's NemotronH: Mamba2, MoE with a latent space, attention, MLP): its MTP layer an
# attention block then an MoE block, as NVIDIA's configs give them.
NEMOTRON_H = dict(FAMILIES["nemotron_h"][1], model_type="nemotron_h", mtp_hybrid_override_pattern="*E",
                  num_nextn_predict_layers=1, max_position_embeddings=CONTEXT)
# DeepSeek-V4 (tests/families.py's: sliding, CSA, HCA and CSA layers over four hyper-connected streams, window 8):
# its MTP layer reads the last layer's streams and runs a sliding-attention MoE layer of its own over them, whose
# window the longer prompts' chains outgrow, then its own hyper head and norm.
DEEPSEEK_V4 = dict(FAMILIES["deepseek_v4"][1], model_type="deepseek_v4", num_nextn_predict_layers=1,
                   max_position_embeddings=CONTEXT)
# HY-V3 (tests/families.py's: MoE, dense, MoE with biases): its MTP layer stored as the layer after the last one, an
# MoE decoder layer between enorm/hnorm/eh_proj and a final_layernorm of its own, as vLLM runs it.
HY_V3 = dict(FAMILIES["hy_v3"][1], model_type="hy_v3", num_nextn_predict_layers=1, max_position_embeddings=CONTEXT)
# HY-V4 (tests/families.py's: five layers over four plain hyper-connected streams, sparse MLA with top-8 keys, some
# layers sharing the top-k of the last full one): its MTP layer under `model.mtp_layers.0.`, a decoder layer without
# hyper-connections (an indexer of its own, whose top-8 the longer prompts outgrow; the MoE of the last entry of
# mlp_layer_types) on the model's final hidden state, then a final_layernorm of its own, as vLLM runs it.
HY_V4 = dict(FAMILIES["hy_v4"][1], model_type="hy_v4", num_nextn_predict_layers=1, max_position_embeddings=CONTEXT)
# MiniMax-M3 (tests/families.py's: block-sparse, full and block-sparse attention; dense, MoE, MoE): its MTP module
# under `model.mtp.layers.0.`, a block-sparse MoE decoder layer between enorm/hnorm/eh_proj and a final_layernorm, as
# vLLM runs it. Blocks of 4, the query's own forced and the best other one kept: the longer prompt's last queries
# skip a block.
MINIMAX_M3 = dict(FAMILIES["minimax_m3"][1], model_type="minimax_m3_vl_text", num_mtp_modules=1,
                  index_topk_blocks=2, index_local_blocks=1, max_position_embeddings=CONTEXT)
# The engine runs two of its layers (the second sharing the first's top-k): an MTP layer whose hidden state is one
# stream's width beside the main layers' four streams.
HY_V4_SMALL = dict(HY_V4, num_hidden_layers=2, mlp_layer_types=["dense", "sparse"], indexer_types=["full", "shared"])
# The engine runs the smaller one of tests/test_deepseek_v4_ops.py (sliding, CSA, HCA; window 6): verify steps of 3
# tokens close CSA windows (4 positions) and HCA ones (8) over drafts, the compressors' buffers are kept after each
# verified token, and the windows' rings follow each sequence whichever of its slots holds the buffers.
DEEPSEEK_V4_SMALL = dict(V4_OPS_CONFIG, model_type="deepseek_v4", vocab_size=256, num_nextn_predict_layers=1,
                         max_position_embeddings=CONTEXT)


def build(hf: dict):
    cfg = models.config_from_hf(hf)
    with nnx.use_eager_sharding(False):
        return models.family(hf["model_type"]).model(cfg, rngs=nnx.Rngs(0), mtp=True)


def reference_drafts(module, tokens: list[int], drafts: list[int]) -> np.ndarray:
    """The MTP chain over `tokens` without a cache, fed the engine's own `drafts` (teacher forcing), as
    transformers' `MtpModel` chains its layers: the logits of each draft [k, V]. With L tokens, layer i runs over
    columns 0 .. L - 2, at column c on token c + 1 + i of the tokens followed by the drafts and on the model's final
    hidden state there (layer 0) or layer i - 1's chained output at the same column; its output at column L - 2
    drafts token i + 1. Drafts past the n layers go through layer j mod n again, at the columns after L - 2, on the
    previous draft and the previous step's chained output. Padded to the context (causal: harmless), so that one
    compiled program serves every length."""
    graphdef, state = nnx.split(module)
    k = len(drafts)

    @jax.jit
    def chain(padded, L, drafts):
        model = nnx.merge(graphdef, state)
        n = min(model.mtp_layers, k)
        positions = jnp.arange(CONTEXT, dtype=jnp.int32)
        hidden = model.mtp_hidden(model(padded[None], positions[None], raw=True)[0])
        stream = jnp.concatenate([jnp.where(positions < L - 1, jnp.roll(padded, -1), 0), jnp.zeros(k, jnp.int32)])
        stream = jax.lax.dynamic_update_slice(stream, drafts, (L - 1,))
        inputs, states, out = [], hidden, []
        for i in range(n):
            following = stream[i:i + CONTEXT]
            h, _ = model.mtp_step(i, following[None], states, positions[None])
            out.append(model.mtp_logits(i, h[0, L - 2]))
            inputs.append((following, states))
            states = model.mtp_chained(i, h)
        chained = states[0, L - 2]
        for j in range(n, k):
            i, at = j % n, L - 2 + j // n
            following, states = inputs[i]
            following, states = following.at[at].set(drafts[j - 1]), states.at[0, at].set(chained)
            inputs[i] = (following, states)
            h, _ = model.mtp_step(i, following[None], states, positions[None])
            out.append(model.mtp_logits(i, h[0, at]))
            chained = model.mtp_chained(i, h[0, at])
        return jnp.stack(out)

    padded = np.zeros(CONTEXT, np.int32)
    padded[:len(tokens)] = tokens
    return np.asarray(chain(padded, len(tokens), jnp.asarray(drafts, jnp.int32)))


@pytest.mark.parametrize("hf,k", [(DEEPSEEK, 2), (dict(QWEN3_NEXT, mtp_num_hidden_layers=1), 3), (QWEN3_5, 1),
                                  (DEEPSEEK_V32, 2), (GLM_MOE_DSA, 1), (ERNIE, 2), (STEP3P7, 2),
                                  (MIMO, 3), (NEMOTRON_H, 2), (DEEPSEEK_V4_SMALL, 2), (HY_V4_SMALL, 2),
                                  (MINIMAX_M3, 2)],
                         ids=["deepseek_v3-k2", "qwen3_next-k3", "qwen3_5-k1", "deepseek_v32-k2", "glm_moe_dsa-k1",
                              "ernie4_5_moe-k2", "step3p7-k2", "mimo_v2_flash-k3",
                              "nemotron_h-k2", "deepseek_v4-k2", "hy_v4-k2", "minimax_m3-k2"])
def test_mtp_drafts_and_greedy_tokens(hf, k):
    """The test takes the MTP layers' drafts the engine read after each step and plants the oracle's (right ones
    and mistakes) in their place, so that every acceptance length occurs; rows of one request keep their own
    drafts, rows of another never speculate. Greedy tokens equal plain decoding's (through Gated DeltaNet layers,
    whose state after the last accepted token each verify step keeps in a slot of its own), and each draft read is
    the cache-less MTP chain's argmax over the tokens verified so far (within 1e-4 of the best logit). Step-3.7 and
    MiMo-V2-Flash chain two layers (MiMo's third draft through the first again): the second layer's pages must hold
    every kept column, rewritten where they were last written from a draft."""
    module = build(hf)
    truth = {f"r{i}": ref for i, ref in enumerate(cache_less_greedy(module))}
    engine = Engine(module, make_mesh(None), jnp.float32, context_length=CONTEXT, config=EngineConfig(
        page_size=8, max_num_seqs=4, batch_buckets=(4,), kv_cache_tokens=512, chunk_buckets=(32,),
        min_width=CONTEXT, speculative=SpeculativeConfig("mtp", num_tokens=k)))  # few programs: one of each kind
    spec = engine.spec
    spec.backoff = False
    oracle = Oracle(truth, seed=k)
    propose, seen = spec.propose, []

    def planted(seq):
        state = spec.row(seq)
        if state.next is not None:
            seen.append((list(seq.tokens), list(state.next)))
        propose(seq)
        if seq.request_id != "r0":
            seq.drafts = oracle.propose(seq, len(seq.drafts))

    spec.propose = planted
    requests = {f"r{i}": (p, greedy(12)) for i, p in enumerate(PROMPTS)}
    requests["r2"] = (PROMPTS[2], dataclasses.replace(greedy(12), speculative=False))
    out = collect(engine, requests, stagger=2)
    assert out == {rid: t[:12] for rid, t in truth.items()}
    assert 0 < spec.stats.accepted_tokens < spec.stats.draft_tokens
    assert len(seen) > 10
    for tokens, drafts in random.Random(k).sample(seen, 6):
        for draft, logits in zip(drafts, reference_drafts(module, tokens, drafts)):
            assert logits[draft] >= logits.max() - 1e-4, (len(tokens), drafts)
    if engine.runner.has_state:
        assert engine.scheduler.state_copies == k + 1
        assert sorted(engine.scheduler.free_slots) == list(range(1, engine.layout.state_slots))


def test_mtp_carry_belongs_to_its_admission():
    """With n chained MTP layers, each call rewrites the n - 1 columns before its own from the hidden states the
    sequence's previous call left in its slot: only while the sequence is in the same admission (one preempted and
    admitted again, or another sequence in that slot, starts fresh), and only with the tokens after those columns on
    the host."""
    from types import SimpleNamespace

    from day0jax.engine.device_proposers import MTPProposer
    from day0jax.engine.requests import SequenceState

    proposer = MTPProposer(SimpleNamespace(mtp_carried=2, layout=SimpleNamespace(spec_tokens=3)))
    seq = SequenceState("r", 0, [5, 6, 7, 8], 4, greedy(4), 0, 0.0, frozenset(), slot=3, slots=[3, 4])
    prefix, slots, fresh = proposer._carry([seq], 2, [3])
    assert prefix.tolist() == [[7, 8], [0, 0]] and slots.tolist() == [3, 0] and fresh.tolist() == [True, True]
    prefix, _, fresh = proposer._carry([seq], 1, [3])
    assert prefix.tolist() == [[7, 8]] and fresh.tolist() == [False]
    assert proposer._carry([seq], 1, [0])[0].tolist() == [[0, 5]]  # nothing before column 0
    assert proposer._carry([seq], 1, [4])[2].tolist() == [True]  # t(4) still on the device
    seq.slots = [3, 4]  # admitted again (the same slots, a new admission)
    assert proposer._carry([seq], 1, [3])[2].tolist() == [True]
    assert proposer._carry([seq], 1, [3])[2].tolist() == [False]


MTP_PROMPTS = [[1, 17, 42, 5, 99, 7, 3], [1] + [(7 * i + 3) % 250 + 3 for i in range(12)]]
HF_CONFIGS = {hf["model_type"]: {k: v for k, v in hf.items() if k not in ("model_type", "num_nextn_predict_layers",
                                                                         "mtp_num_hidden_layers", "num_mtp_modules")}
              for hf in (DEEPSEEK, QWEN3_NEXT, DEEPSEEK_V32, GLM_MOE_DSA, ERNIE, STEP3P7, NEMOTRON_H, DEEPSEEK_V4,
                         HY_V3, HY_V4, MINIMAX_M3)}
HF_CONFIGS["mimo_v2_flash"] = {k: v for k, v in MIMO.items() if k != "model_type"}  # the reference reads the count
MTP_LAYERS = {"step3p7": 2, "mimo_v2_flash": 2}


@pytest.fixture(scope="module")
def mtp_checkpoints(tmp_path_factory):
    """A tiny random folder of each family of `HF_CONFIGS` with its MTP layers in its checkpoints' layout, and the
    reference MTP logits (float64; the decoder layer transformers' own, ERNIE's, Step-3.7's and MiMo-V2-Flash's whole
    MTP layers)."""
    from conftest import run_reference

    root = tmp_path_factory.mktemp("mtp")
    run_reference([{"op": "mtp", "family": family, "config": config, "seed": 0, "out": str(root / family),
                    "prompts": MTP_PROMPTS, "reference": str(root / f"{family}.npz")}
                   for family, config in HF_CONFIGS.items()], root)
    return {family: (root / family, dict(np.load(root / f"{family}.npz"))) for family in HF_CONFIGS}


@pytest.mark.parametrize("family", list(HF_CONFIGS))
def test_mtp_layers_convert_load_and_match_the_reference(mtp_checkpoints, family, tmp_path):
    import day0jax
    from convert import convert_checkpoint
    from convert.convert import Options
    from day0jax.check import check
    from day0jax.core.errors import CheckpointError

    hf, reference = mtp_checkpoints[family]
    ckpt = convert_checkpoint(hf, tmp_path / "with", progress=False).dst
    manifest = json.loads((ckpt / "day0jax.json").read_text())
    mtp_params = [name for name in manifest["params"] if name.startswith("mtp.")]
    assert mtp_params and manifest["parts"]["mtp"]["prefix"] == "mtp."
    groups = {manifest["params"][name]["group"] for name in mtp_params}
    assert not groups & {p["group"] for name, p in manifest["params"].items() if not name.startswith("mtp.")}
    bare = convert_checkpoint(hf, tmp_path / "without", progress=False, options=Options(no_mtp=True)).dst
    assert not any(name.startswith("mtp.") for name in json.loads((bare / "day0jax.json").read_text())["params"])
    # check lists them (operators of layer L, parameters), from the source and from the checkpoint.
    for path in (hf, ckpt):
        report = check(path, dtype="float32")
        assert report.supported, report.reasons
        assert report.mtp["layers"] == MTP_LAYERS.get(family, 1) and report.mtp["parameters"] > 0
        text = HF_CONFIGS[family].get("text_config", HF_CONFIGS[family])
        L = text.get("num_hidden_layers") or len(text["layers_block_type"])
        last = L + report.mtp["layers"] - 1
        assert any(str(last) in str(row["layers"]) for row in report.ops if "attention" in row["op"])  # 0-last
    engine = EngineConfig(max_num_seqs=1, chunk_buckets=(32,), max_model_len=64, min_width=64)
    load = lambda path, **kw: day0jax.load(path, dtype="float32", kernels="reference",  # noqa: E731
                                           engine=dataclasses.replace(engine, **kw))
    plain = load(ckpt)  # its optional part left unread
    assert plain.module.mtp is None
    with pytest.raises(CheckpointError, match="--no-mtp"):
        load(bare, speculative="mtp")
    model = load(ckpt, speculative="mtp")
    assert model.memory_plan.kv_cache_bytes > plain.memory_plan.kv_cache_bytes  # the MTP layers' pages planned
    for i, prompt in enumerate(MTP_PROMPTS):
        chain = mtp_chain_logits(model.module, jnp.asarray(prompt, jnp.int32)[None])
        for j, ours in enumerate(chain):
            ours, ref = np.asarray(ours)[0], reference[f"logits_{i}" if j == 0 else f"logits_{i}_{j}"]
            # float32 against the float64 reference: at most 5e-6 of the logit scale seen (MiniMax-M3's 4.7e-6,
            # whose main model alone is 2.7e-6 from transformers' float32; the others 2.5e-6 or less).
            assert np.abs(ours - ref).max() <= 1e-5 * np.abs(ref).max(), (i, j, np.abs(ours - ref).max())


@nnx.jit
def mtp_chain_logits(module, ids):
    """Each MTP layer's logits over prompt `ids` [1, T + 1], without a cache, as one program (run eagerly, each of its
    operations compiles alone: hundreds of them): layer 0 on the model's final hidden states and the tokens after
    them, layer j on layer j - 1's chained output and the tokens j + 1 ahead. A list of [1, T - j, V]."""
    T = ids.shape[1] - 1
    positions = lambda n: jnp.arange(n, dtype=jnp.int32)[None]  # noqa: E731
    hidden = module.mtp_hidden(module(ids, positions(T + 1), raw=True)[0])
    h, _ = module.mtp_step(0, ids[:, 1:], hidden[:, :T], positions(T))
    out = [module.mtp_logits(0, h)]
    for j in range(1, module.mtp_layers):
        n = T - j
        h, _ = module.mtp_step(j, ids[:, 1 + j:], module.mtp_chained(j - 1, h)[:, :n], positions(n))
        out.append(module.mtp_logits(j, h))
    return out


def test_minimax_m3_multimodal_checkpoint_names_its_mtp_modules_as_minimax_does():
    """The multimodal checkpoint keeps MiniMax's own names: MTP module i under `language_model.model.mtp.layers.{i}.`,
    its decoder layer's tensors under `transformer_layer.` named as a main layer's there (the indexer's `index_*`,
    the MoE as `block_sparse_moe` with each expert's w1 / w3 / w2 apart)."""
    cfg = models.config_from_hf(dict(model_type="minimax_m3_vl", text_config=dict(FAMILIES["minimax_m3"][1],
                                                                                  num_mtp_modules=1)))
    fam = models.family("minimax_m3_vl")
    names = {name for info in models.param_infos(models.abstract_model(cfg, mtp=True)) if info.path.startswith("mtp.")
             for name in fam.hf_source(cfg, info.path, info.shape, info.metadata).names}
    at = "language_model.model.mtp.layers.0."
    assert {at + "enorm.weight", at + "hnorm.weight", at + "eh_proj.weight", at + "final_layernorm.weight",
            at + "transformer_layer.self_attn.index_q_proj.weight", at + "transformer_layer.input_layernorm.weight",
            at + "transformer_layer.block_sparse_moe.experts.3.w2.weight",
            at + "transformer_layer.block_sparse_moe.e_score_correction_bias"} <= names
    assert all(name.startswith(at) for name in names)


def test_ernie_refuses_more_than_one_mtp_layer():
    """HF's ERNIE 4.5 MoE runs a single MTP layer (its config refuses more); so does ours, by name."""
    from day0jax.core.errors import UnsupportedArchitecture

    with pytest.raises(UnsupportedArchitecture, match="num_nextn_predict_layers"):
        models.config_from_hf(dict(ERNIE, num_nextn_predict_layers=2))


@pytest.mark.parametrize("family,extra,match,shipped", [
    ("minimax_m2", dict(use_mtp=True, num_mtp_modules=3), r"prediction modules \(num_mtp_modules\) have no",
     "model.layers.4.eh_proj.weight"),
    ("mistral_large4", {}, r"draft head \(mtp_dspark\) is not implemented", "mtp_dspark.fc.weight"),
    ("qwen4_exp", {}, r"prediction layers \(mtp\.\*\) are not implemented", "mtp.layers.0.mlp.gate.weight")])
def test_mtp_modules_not_implemented_are_refused_by_name(family, extra, match, shipped):
    """MiniMax-M2's configs declare MTP modules whose forward nothing public defines; Mistral Large 4's and
    Qwen4-Exp's are not implemented: speculative method 'mtp' is refused naming them, and conversion drops their
    tensors by name (the converter refuses any tensor it neither reads nor drops)."""
    from convert.convert import dropped_tensors
    from day0jax.core.errors import UnsupportedArchitecture

    model_type, config, _ = FAMILIES[family]
    cfg = models.config_from_hf(dict(config, model_type=model_type, **extra))
    with pytest.raises(UnsupportedArchitecture, match=match):
        models.abstract_model(cfg, mtp=True)
    assert any(re.fullmatch(p, shipped) for p in dropped_tensors(models.family(model_type), cfg))


@pytest.mark.parametrize("change,match", [(dict(num_nextn_predict_layers=2), "num_nextn_predict_layers=2"),
                                          (dict(mtp_hybrid_override_pattern="ME"), "mtp_hybrid_override_pattern"),
                                          (dict(mtp_hybrid_override_pattern="*E*"), "exactly one attention")])
def test_nemotron_h_mtp_layers_beyond_the_published_forward_are_refused(change, match):
    """The published forward runs one MTP layer whose blocks are attention, MoE or MLP with exactly one attention
    block (its KV pages): anything else is refused by key."""
    from day0jax.core.errors import UnsupportedArchitecture

    with pytest.raises(UnsupportedArchitecture, match=match):
        models.abstract_model(models.config_from_hf(dict(NEMOTRON_H, **change)), mtp=True)


@pytest.mark.parametrize("hf,change,match", [
    (DEEPSEEK_V4, dict(layer_types=[*DEEPSEEK_V4["layer_types"], "compressed_sparse_attention"]),
     "layer_types.*multi-token-prediction layer 0 with compressed attention"),
    (DEEPSEEK_V4, dict(mlp_layer_types=[*DEEPSEEK_V4["mlp_layer_types"], "hash_moe"]),
     "mlp_layer_types.*multi-token-prediction layer 0 with hash routing"),
    (HY_V3, dict(mlp_layer_types=["dense"] * 3), "num_nextn_predict_layers.*without experts"),
    (HY_V4, dict(mlp_layer_types=[*HY_V4["mlp_layer_types"], "hash_moe"]),
     "mlp_layer_types.*hash_moe.*multi-token-prediction layer"),
    (MINIMAX_M3, dict(mtp_transformer_layers=2), "mtp_transformer_layers=2 is not implemented")],
    ids=["deepseek_v4-compressed", "deepseek_v4-hash", "hy_v3-dense", "hy_v4-unknown-mlp", "minimax_m3-two-layers"])
def test_mtp_layers_other_than_the_published_forward_are_refused(hf, change, match):
    """DeepSeek-V4's MTP layer is a sliding-attention layer with a scored MoE, HY-V3's an MoE layer, HY-V4's a dense
    or MoE one, MiniMax-M3's one decoder layer per module: a config that declares another kind for it is refused by
    key, where the published forward would be left."""
    from day0jax.core.errors import UnsupportedArchitecture

    models.abstract_model(models.config_from_hf(hf), mtp=True)  # as declared: built
    with pytest.raises(UnsupportedArchitecture, match=match):
        models.abstract_model(models.config_from_hf(dict(hf, **change)), mtp=True)
