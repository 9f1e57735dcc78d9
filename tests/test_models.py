"""Every family against transformers at float32: logits, greedy decoding with the KV cache, batches, and each
family's features (tests/mutations.py).

Tolerance: max |ours - transformers| <= tolerance(family) * max |transformers| over each prompt's logits (relative
to the logit scale, float32 both sides): RTOL, or the family's entry in TOLERANCE with its reason (tests/parity.py).
Models load with kernels="strict", so a kernel that disagrees with its reference in the startup self-test fails here
rather than running the reference in its place.
"""

import dataclasses
import gc

import jax
import numpy as np
import pytest

import day0jax
import mutations
from parity import rel_err, tolerance
from families import FAMILIES, GENERATE, PROMPTS, parity_engine

MEASURED: dict[str, float] = {}  # family -> worst relative logits error; conftest prints it after the run


@pytest.fixture(scope="module")
def family(request, converted):
    """(name, model) of the family `request.param`, loaded in float32 (a GPU's default is bfloat16). Module-scoped
    and parametrized (indirectly, by each test), so pytest runs one family's tests together, then drops the model
    and JAX's caches of its programs: every XLA:CPU executable keeps memory maps of its own, and all families'
    programs at once pass the process's limit (vm.max_map_count, 65530 on the CI machine), where XLA crashes."""
    yield request.param, day0jax.load(converted[request.param], dtype="float32", kernels="strict",
                                      engine=parity_engine())
    jax.clear_caches()
    gc.collect()


ALL = list(FAMILIES)
BATCH_INVARIANT = [n for n, f in FAMILIES.items() if f[2]]


def padded_batch(rows=PROMPTS) -> np.ndarray:
    """`rows` of token ids right-padded into one batch."""
    batch = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for i, p in enumerate(rows):
        batch[i, :len(p)] = p
    return batch


@pytest.mark.parametrize("family", ALL, indirect=True)
def test_logits_match_transformers(family, tiny):
    """Each prompt's logits against transformers' for that prompt alone. Batch-invariant families run the prompts as
    one right-padded batch (one program for all three: padding must not leak into any row); the others, whose RoPE
    depends on the longest sequence of the call, one prompt per call."""
    name, model = family
    if FAMILIES[name][2]:
        together = model.logits(padded_batch())
        rows = [together[i, :len(p)] for i, p in enumerate(PROMPTS)]
    else:
        rows = [model.logits([p])[0] for p in PROMPTS]
    for i, ours in enumerate(rows):
        ref = tiny[name]["ref"][f"logits_{i}"]
        assert ours.shape == ref.shape
        MEASURED[name] = max(MEASURED.get(name, 0.0), rel_err(ours, ref))
        assert rel_err(ours, ref) < tolerance(name), f"{name} prompt {i}: relative error {rel_err(ours, ref):.2e}"


@pytest.mark.parametrize("family", ALL, indirect=True)
def test_greedy_decode_matches_transformers(family, tiny):
    name, model = family
    batch_invariant = FAMILIES[name][2]
    if batch_invariant:
        outs = model.generate(PROMPTS, GENERATE, ignore_eos=True)
    else:
        outs = [model.generate([p], GENERATE, ignore_eos=True)[0] for p in PROMPTS]
    for i, out in enumerate(outs):
        assert out == tiny[name]["ref"][f"generated_{i}"].tolist(), f"{name} prompt {i}"


@pytest.mark.parametrize("family", BATCH_INVARIANT, indirect=True)
def test_batched_logits_equal_single(family, tiny):
    """A padded row of a batch gets the logits it gets alone, and a single prompt's call matches transformers."""
    name, model = family
    i = 1  # shorter than the batch: padded there; alone, it pads to the same width bucket (one program less)
    alone = model.logits([PROMPTS[i]])[0]
    assert rel_err(alone, tiny[name]["ref"][f"logits_{i}"]) < tolerance(name), name
    # Not bit-equal: a batch of 3 rows and a single row take different matmul blockings (the CPU linear kernel
    # and XLA's dot choose by row count), so the rounding differs as it does against transformers: the parity
    # metric and tolerance apply. Worst seen: 1.35e-5 of the logit scale (qwen3_5, tolerance 3e-5: its chunked
    # delta rule amplifies rounding), 3.8e-6 for gemma4, ernie4_5_moe's 1.4e-5 absolute well inside 1e-5.
    assert rel_err(model.logits(padded_batch())[i, :len(PROMPTS[i])], alone) < tolerance(name), name


@pytest.mark.parametrize("family", ["mistral"], indirect=True)  # sliding window: the cache path must apply it too
def test_cached_decode_equals_full_forward(family):
    """Greedy tokens from the KV-cache path are the argmax of the no-cache forward over the same sequence."""
    _, model = family
    prompt = PROMPTS[2]
    new = model.generate([prompt], 10, ignore_eos=True)[0]
    full = model.logits([prompt + new])[0]
    assert new == full[len(prompt) - 1:-1].argmax(-1).tolist()


@pytest.mark.parametrize("family", ["minimax_m3", "glm5_next"], indirect=True)
def test_block_sparse_prefill_in_chunks_equals_full_forward(family, converted):
    """Block-sparse attention with the prompt prefilled in chunks of 3 positions across blocks of 4: each chunk's
    queries choose among the blocks cached so far and their own (the indexer keys cached per token; GLM-5-Next's
    pooled indexer its keys and pooling logits, its linear-attention layers their state), as the no-cache forward
    over the whole sequence chooses."""
    name, _ = family
    engine = dataclasses.replace(parity_engine(), chunk_buckets=(3,))
    model = day0jax.load(converted[name], dtype="float32", kernels="strict", engine=engine)
    outs = model.generate(PROMPTS, 10, ignore_eos=True)
    for prompt, new in zip(PROMPTS, outs):
        full = model.logits([prompt + new])[0]
        assert new == full[len(prompt) - 1:-1].argmax(-1).tolist()

@pytest.mark.parametrize("family", ["qwen4_exp"], indirect=True)
def test_ngram_context_carried_across_prefill_chunks(family, converted, tiny):
    """Per-layer n-gram embeddings with the prompt prefilled in chunks of 2 positions, n-grams of 3: every chunk
    boundary falls inside an n-gram (and beside the eos of prompts 1 and 2), so each chunk's first tokens hash the
    previous chunk's last ids, carried in the state; the greedy tokens are transformers'."""
    name, _ = family
    engine = dataclasses.replace(parity_engine(), chunk_buckets=(2,))
    model = day0jax.load(converted[name], dtype="float32", kernels="strict", engine=engine)
    outs = model.generate(PROMPTS, GENERATE, ignore_eos=True)
    for i, out in enumerate(outs):
        assert out == tiny[name]["ref"][f"generated_{i}"].tolist(), f"prompt {i}"


@pytest.mark.parametrize("family", BATCH_INVARIANT, indirect=True)
def test_batched_cached_decode_equals_full_forward(family):
    """Every family: greedy tokens decoded with the KV cache, prompts of different lengths in one batch, are the
    argmax of the no-cache forward pass over each prompt plus its continuation."""
    name, model = family
    outs = model.generate(PROMPTS, 10, ignore_eos=True)
    full = model.logits(padded_batch([p + new for p, new in zip(PROMPTS, outs)]))  # the parity test's program
    for i, (prompt, new) in enumerate(zip(PROMPTS, outs)):
        assert new == full[i, len(prompt) - 1:len(prompt) + len(new) - 1].argmax(-1).tolist(), name


# Each feature param is (family, feature): its value names one test alone, so that pytest, which groups the tests of
# module-scoped params by value, keeps each family's tests together.
FEATURES = [pytest.param(name, (name, feature), id=mutations.feature_id(name, feature))
            for name, features in mutations.MUTATIONS.items() for feature, _ in features]
_MUTATED: dict[str, dict] = {}  # family -> feature (None: unmutated) -> logits or the exception


def test_every_family_lists_its_features():
    """Each family of tests/families.py has its features in tests/mutations.py, under names unique to it."""
    assert set(mutations.MUTATIONS) == set(FAMILIES)
    for name, features in mutations.MUTATIONS.items():
        names = [feature for feature, _ in features]
        assert names and len(set(names)) == len(names), name


# scope="module": grouped with the family's other tests, on the same loaded model.
@pytest.mark.parametrize("family, feature", FEATURES, indirect=["family"], scope="module")
def test_feature_moves_logits(family, feature, tiny):
    """Each feature of the family, broken in day0jax alone (tests/mutations.py), moves the logits away from
    transformers' by at least MUTATION_FACTOR times the parity tolerance: the parity test sees it. All of a family's
    mutations run in one compiled program, beside an unmutated copy that must still match transformers."""
    name, model = family
    feature = feature[1]
    if name not in _MUTATED:
        _MUTATED.clear()  # one family at a time, as the fixture
        _MUTATED[name] = mutations.mutated_logits(model, dict(mutations.MUTATIONS[name]), PROMPTS[mutations.PROMPT])
    out, ref = _MUTATED[name], tiny[name]["ref"][f"logits_{mutations.PROMPT}"]
    assert rel_err(out[None], ref) < tolerance(name), "the unmutated copy does not reproduce the parity logits"
    if isinstance(out[feature], Exception):
        raise out[feature]
    assert np.isfinite(out[feature]).all(), f"{name}: {feature} broken gives non-finite logits"
    moved = rel_err(out[feature], ref)
    assert moved >= mutations.MUTATION_FACTOR * tolerance(name), (
        f"{name}: without {feature!r} the logits move by {moved:.2e} relative, less than "
        f"{mutations.MUTATION_FACTOR} x the tolerance {tolerance(name):.0e}")


def test_moe_runs_only_routed_rows(monkeypatch):
    """The MoE block sends tokens x top_k rows through the grouped matmul (never every expert for every token),
    grouped by expert, and equals the dense per-token sum it stands for."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from day0jax.layers import moe
    from kernels_pallas.moe import api as moe_api

    calls = []
    real = moe_api.grouped_matmul

    def spy(lhs, rhs, group_sizes, implementation=None):
        calls.append((lhs.shape, rhs.shape, np.asarray(group_sizes)))
        return real(lhs, rhs, group_sizes)
    monkeypatch.setattr(moe.moe_op, "grouped_matmul", spy)
    E, D, F, k, M = 8, 16, 24, 2, 5
    with nnx.use_eager_sharding(False):  # logical axis names, no mesh: as models.abstract_model builds
        block = moe.MoE(moe.Router(D, E, k, routing="softmax_topk", norm_topk_prob=True, rngs=nnx.Rngs(0)),
                        moe.Experts(E, D, F, moe.swiglu("silu"), rngs=nnx.Rngs(1)))
    x = jax.random.normal(jax.random.key(2), (1, M, D))
    out = block(x)[0]
    assert [c[0] for c in calls] == [(M * k, D), (M * k, D), (M * k, F)]
    assert all(c[2].sum() == M * k and c[1][0] == E for c in calls)
    weights, experts = block.gate(x[0])
    ex = block.experts
    dense = jnp.stack([sum(weights[m, j] * (jax.nn.silu(x[0, m] @ ex.gate_proj[experts[m, j]])
                                            * (x[0, m] @ ex.up_proj[experts[m, j]])) @ ex.down_proj[experts[m, j]]
                           for j in range(k)) for m in range(M)])
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense), rtol=1e-5, atol=1e-5)


# Multimodal checkpoints whose language model is a supported text family: (family, the text entry in FAMILIES,
# tiny sub-configs of the other towers, what the converter's log must name as dropped, a check on the config).
MULTIMODAL = {
    # `language_model.` before the text model's names; a vision tower and projector.
    "llama4": ("llama4", dict(vision_config=dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vision_output_dim=64,
        image_size=32, patch_size=8, projector_input_dim=64, projector_output_dim=64)),
        ("vision_model", "multi_modal_projector", "images are not supported yet"),
        lambda c: c.layer_kinds == ("chunked_attention", "full_attention")),
    # Mistral's own tensor names, the language model's beside a Pixtral tower and its projector.
    "mistral_large4": ("mistral_large4", dict(vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
        image_size=28, patch_size=14)),
        ("vision_encoder", "patch_merger", "pre_mm_projector_norm", "vision_language_adapter",
         "images are not supported yet"),
        lambda c: c.kv_sources == (None, None, None, 0, 1)),
    # MiniMax's own tensor names (transformers saves them so): the causal LM under `language_model.`, the MoE as
    # `block_sparse_moe` with experts apart, the indexer's `index_*` projections and norms; a vision tower, its
    # projector and patch merger.
    "minimax_m3_vl": ("minimax_m3", dict(vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=14,
        image_size=28), projector_hidden_size=32),
        ("vision_tower", "multi_modal_projector", "patch_merge_mlp", "images are not supported yet"),
        lambda c: c.layer_kind(2) == "minimax_m3_sparse"),
    # The language model under `model.language_model.`, its head as `lm_head`; the vision tower as `model.visual`.
    "qwen4_exp": ("qwen4_exp", dict(vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, num_position_embeddings=16,
        patch_size=14)), ("visual", "images are not supported yet"),
        lambda c: c.layer_kinds[1] == "indexed_attention" and c.ple_layers == (0, 2)),
}


@pytest.mark.parametrize("family", list(MULTIMODAL))
def test_multimodal_checkpoint_converts_as_its_language_model(family, tmp_path, caplog):
    """A multimodal checkpoint: the language model's tensors convert, the other towers' are dropped with a log line
    naming them, and the logits equal transformers' on text."""
    import logging

    from conftest import run_reference
    from convert.convert import convert_checkpoint

    entry, towers, dropped, check_config = MULTIMODAL[family]
    hf = tmp_path / "hf"
    run_reference([{"op": "tiny_hf", "family": family, "config": dict(text_config=FAMILIES[entry][1], **towers),
                    "seed": 0, "multimodal": True, "out": str(hf)},
                   {"op": "run", "model": str(hf), "prompts": PROMPTS, "generate": 0,
                    "out": str(tmp_path / "ref.npz")}], tmp_path)
    with caplog.at_level(logging.INFO, logger="convert"):
        convert_checkpoint(hf, tmp_path / "d0", progress=False)
    for text in dropped:
        assert text in caplog.text, text
    model = day0jax.load(tmp_path / "d0", dtype="float32", kernels="strict")
    assert model.config.is_composite and check_config(model.config)
    ref = np.load(tmp_path / "ref.npz")
    for i, prompt in enumerate(PROMPTS):
        ours, theirs = model.logits([prompt])[0], ref[f"logits_{i}"]
        assert rel_err(ours, theirs) < tolerance(entry), f"prompt {i}: relative error {rel_err(ours, theirs):.2e}"
