"""Reasoning models: which reasoning syntax a checkpoint's chat template and tokenizer teach, splitting an output into
its reasoning and its answer as it streams, and the grammar that holds only the answer to a request's grammar.

The syntax is chosen once, when the server loads the model (`choose`), from marks in the template (as tool-call
syntaxes are), or named with `serve --reasoning-parser NAME|none`. A template whose reasoning markup is recognized but
not split here is served with the reasoning left in the content, and the log says so once.
"""

from __future__ import annotations

import logging

from day0jax.serve.reasoning.base import EITHER, IN_ANSWER, IN_REASONING, Reasoning, ReasoningSyntax, Split, Splitter
from day0jax.serve.reasoning.harmony import HarmonySyntax
from day0jax.serve.reasoning.think import ThinkSyntax

__all__ = ["EITHER", "IN_ANSWER", "IN_REASONING", "Reasoning", "ReasoningSyntax", "SYNTAXES", "Split", "Splitter",
           "by_name", "choose", "syntax_of"]

log = logging.getLogger("day0jax.serve")

SYNTAXES: dict[str, ReasoningSyntax] = {
    "think": ThinkSyntax("think"),
    "seed_oss": ThinkSyntax("seed_oss", "<seed:think>", "</seed:think>"),
    "hunyuan": ThinkSyntax("hunyuan", answer_open="<answer>", answer_close="</answer>"),
    "mistral": ThinkSyntax("mistral", "[THINK]", "[/THINK]"),
    "gemma4": ThinkSyntax("gemma4", "<|channel>thought", "<channel|>"),
    "harmony": HarmonySyntax("harmony"),
}
# Other servers' names for the same syntaxes, so that their flags work here.
ALIASES = {"deepseek_r1": "think", "deepseek_v3": "think", "qwen3": "think", "glm45": "think", "minimax_m2": "think",
           "kimi_k2": "think", "ernie45": "think", "exaone4": "think", "smollm3": "think", "hunyuan_a13b": "hunyuan",
           "gpt_oss": "harmony", "openai_gptoss": "harmony", "magistral": "mistral"}
# The first mark found in a template names its syntax (harmony's needs two: <|channel|> and <|message|>).
MARKS = [("<seed:think>", "seed_oss"), ("<|channel>", "gemma4"), ("[THINK]", "mistral"), ("<think>", "think"),
         ("</think>", "think")]
# For a template without marks, the tokens that name a syntax where the tokenizer holds them all.
TOKENS = [(("<seed:think>", "</seed:think>"), "seed_oss"), (("[THINK]", "[/THINK]"), "mistral"),
          (("<think>", "</think>"), "think")]
# Reasoning markup of released templates that is recognized but not split, by a mark in the template.
UNSPLIT = {"Here is my thought process:": "Granite's prose markers ('Here is my thought process:' ... 'Here is my "
                                          "response:')",
           "[BEGIN FINAL RESPONSE]": "Apriel's [BEGIN FINAL RESPONSE] markers",
           "<|START_THINKING|>": "Command A's <|START_THINKING|> blocks"}


def by_name(name: str) -> ReasoningSyntax | None:
    """The syntax a `--reasoning-parser` value names (None for "none").

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name == "none":
        return None
    name = ALIASES.get(name, name)
    if name not in SYNTAXES:
        known = sorted(set(SYNTAXES) | set(ALIASES) | {"none"})
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(known)}")
    return SYNTAXES[name]


def syntax_of(template: str | None, tokenizer) -> tuple[ReasoningSyntax | None, str | None]:
    """The reasoning syntax a chat template teaches (or, for a template without any mark, its tokenizer's tokens):
    (the syntax, None), (None, a description of markup recognized but not split), or (None, None) for a template
    without reasoning."""
    template = template or ""
    answer = "<answer>" in template or tokenizer.token_id("<answer>") is not None
    if "<|channel|>" in template and "<|message|>" in template:
        return SYNTAXES["harmony"], None
    for mark, name in MARKS:
        if mark in template:
            return SYNTAXES["hunyuan" if name == "think" and answer else name], None
    for mark, what in UNSPLIT.items():
        if mark in template:
            return None, what
    for marks, name in TOKENS:
        if all(tokenizer.token_id(m) is not None for m in marks):
            return SYNTAXES["hunyuan" if name == "think" and answer else name], None
    return None, None


def choose(flag: str | None, tokenizer) -> ReasoningSyntax | None:
    """The server's reasoning syntax: the one `flag` names (`--reasoning-parser`; "none": no split), else the one
    the tokenizer's chat template teaches; logs the choice (once: a template whose markup is not split names it).

    Raises:
        ValueError: `flag` names no syntax.
    """
    if flag is not None:
        syntax = by_name(flag)
        log.info("reasoning: %s (--reasoning-parser)", syntax.name if syntax else "not split")
        return syntax
    syntax, unsplit = syntax_of(tokenizer.chat_template, tokenizer)
    if syntax is not None:
        log.info("reasoning: split as %s (read from the chat template)", syntax.name)
    elif unsplit:
        log.warning("reasoning: the chat template writes reasoning as %s, which day0jax does not split; it stays in "
                    "the content", unsplit)
    return syntax
