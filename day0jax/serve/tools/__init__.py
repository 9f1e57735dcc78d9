"""Tool calling: which tool-call syntax a chat template teaches its model, parsing that syntax out of the output, and
the grammar that forces a call (tool_choice "required" or a named function) with arguments that validate.

Syntaxes live by kind: JSON arguments (`json_calls`), XML-like tags (`tagged`), Python calls (`pythonic`), Gemma 4's
own notation (`gemma4`) and gpt-oss's harmony messages (`harmony`). A template that mentions tools in another syntax
is refused by name rather than served with calls left in the text.
"""

from __future__ import annotations

import re

from day0jax.engine.grammar import GrammarError
from day0jax.serve.tools import gemma4, harmony, pythonic, tagged
from day0jax.serve.tools.base import ToolCall, ToolSyntax, Tools
from day0jax.serve.tools.json_calls import JsonSyntax, MistralArgsSyntax, SectionSyntax

__all__ = ["SYNTAXES", "ToolCall", "ToolSyntax", "Tools", "syntax_of"]

SYNTAXES: dict[str, ToolSyntax] = {
    "hermes": JsonSyntax("hermes", "<tool_call>", "arguments", "</tool_call>"),
    "mistral": JsonSyntax("mistral", "[TOOL_CALLS]", "arguments"),
    "mistral_args": MistralArgsSyntax("mistral_args", "[TOOL_CALLS]"),
    "llama3_json": JsonSyntax("llama3_json", "", "parameters"),
    # <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>
    "deepseek_v3": SectionSyntax("deepseek_v3", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                                 "<｜tool▁call▁begin｜>", "function<｜tool▁sep｜>", "\n```json\n",
                                 "\n```<｜tool▁call▁end｜>", "\n"),
    # <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>
    "deepseek_v31": SectionSyntax("deepseek_v31", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                                  "<｜tool▁call▁begin｜>", "", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"),
    # <|tool_call_begin|>functions.NAME:i<|tool_call_argument_begin|>ARGS<|tool_call_end|>
    "kimi_k2": SectionSyntax("kimi_k2", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                             "<|tool_call_begin|>", "functions.", ":{i}<|tool_call_argument_begin|>",
                             "<|tool_call_end|>"),
    **tagged.SYNTAXES, **pythonic.SYNTAXES, **gemma4.SYNTAXES, **harmony.SYNTAXES,
}

PARSED = ("Hermes <tool_call> JSON, Qwen3-Coder/Qwen3.5 <function=...>, GLM <arg_key>, MiniMax-M2 <invoke>, Seed-OSS, "
          "DeepSeek V3/V3.1 sections and V3.2 DSML, Kimi K2, Llama 3 JSON, Mistral [TOOL_CALLS], LFM2 pythonic and "
          "Gemma 4 calls, gpt-oss harmony messages")
# The first mark found in a template names its syntax (more specific marks first: GLM's and Qwen3.5's templates
# also contain Hermes's <tool_call>; gpt-oss's writes "to=" and "functions." apart, and ends calls with <|call|>).
MARKS = [
    ("to=functions.", "harmony"), ("<|call|>", "harmony"), ("｜DSML｜", "deepseek_v32"),
    ("<|tool_calls_section_begin|>", "kimi_k2"), ("<arg_key>", "glm"), ("<minimax:tool_call>", "minimax_m2"),
    ("<seed:tool_call>", "seed_oss"),
    ("<function=", "qwen3_coder"), ("<|tool_call_start|>", "lfm2"), ("<|tool_list_start|>", "lfm2"),
    ("<|tool_call>", "gemma4"), ("[ARGS]", "mistral_args"), ("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"), ("ipython", "llama3_json"),
]


def syntax_of(template: str | None) -> ToolSyntax:
    """The tool-call syntax a chat template teaches.

    Raises:
        GrammarError: (param "tools") no template, a template that never reads `tools`, or a syntax not parsed here.
    """
    if not template or not re.search(r"\btools\b", template):
        raise GrammarError("this model's chat template has no tool support (it never reads `tools`)", "tools")
    if "tool▁calls▁begin" in template:  # V3 wraps the arguments in a json code block, V3.1 writes them bare
        return SYNTAXES["deepseek_v3" if "```json" in template else "deepseek_v31"]
    for mark, name in MARKS:
        if mark in template:
            if name == "glm":  # GLM-4.5/4.6 put each tag on its own line, GLM-4.7 and GLM-5 do not
                name = "glm45" if re.search(r"</arg_key>(\n|\\n)<arg_value>", template) else "glm47"
            return SYNTAXES[name]
    raise GrammarError(f"this model's chat template calls tools in a syntax day0jax does not parse (it parses "
                       f"{PARSED})", "tools")
