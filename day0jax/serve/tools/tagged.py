"""Tool-call syntaxes in XML-like tags: the function's name in one tag, each argument in its own, strings written
bare and other values as JSON.

- "qwen3_coder": `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`
  (Qwen3-Coder, Qwen3.5);
- "seed_oss": the same inside `<seed:tool_call>` (Seed-OSS);
- "glm45" and "glm47": `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call>`, with
  newlines between the tags (GLM-4.5/4.6) or without (GLM-4.7, GLM-5);
- "minimax_m2": `<minimax:tool_call><invoke name="NAME"><parameter name="KEY">VALUE</parameter></invoke>...`;
- "deepseek_v32": DeepSeek V3.2's DSML, `<｜DSML｜invoke name="NAME">` with
  `<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>`, where `string` says whether the value
  is bare text or JSON.

Which values are bare strings follows the function's parameter schema (a parameter that can only be a string),
as transformers' response parser reads them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from day0jax.serve.tools.base import (ToolCall, ToolSyntax, Tools, arguments, coerce, functions, is_string,
                                      json_value, lark_text, raw_string, sequence)


@dataclass(frozen=True)
class TaggedSyntax(ToolSyntax):
    """Calls inside sections `marker` ... `section_end`; each call `call_open` (holding "{name}") + its arguments +
    `call_close`, each argument `param_open` (holding "{key}", and "{string}" where the syntax says which values
    are bare) + value + `param_close`. `calls_per_section` 1: a section per call (the template writes them so);
    0: all calls in one section. A newline in these parts stands for any whitespace when parsing."""

    section_end: str = ""
    call_open: str = ""
    call_close: str = ""
    param_open: str = ""
    param_close: str = ""
    calls_per_section: int = 1

    @property
    def specials(self) -> tuple[str, ...]:
        return (self.marker, self.section_end)

    def _regex(self, part: str, **groups: str) -> str:
        out = re.escape(part).replace("\\\n", "\n").replace("\n", r"\s*")
        for name, pattern in groups.items():
            out = out.replace(re.escape("{" + name + "}"), f"(?P<{name}>{pattern})")
        return out

    def parse(self, text: str, tools: Tools) -> tuple[str, list[ToolCall]]:
        start = text.find(self.marker)
        if start < 0:
            return text, []
        section = re.compile(r"\s*" + self._regex(self.marker) + r"(?P<body>.*?)" + self._regex(self.section_end), re.S)
        call = re.compile(r"\s*" + self._regex(self.call_open, name=r"[^\s<>\"=]+") + r"(?P<args>.*?)"
                          + self._regex(self.call_close) + (r"\s*" if self.call_close else r"\s*$"), re.S)
        param = re.compile(r"\s*" + self._regex(self.param_open, key=r"[^<>\"\n]+?", string=r"true|false")
                           + r"\s*(?P<value>.*?)\s*" + self._regex(self.param_close) + r"\s*", re.S)
        calls, pos = [], start
        while (s := section.match(text, pos)) is not None:
            body, at = s.group("body"), 0
            while at < len(body) and (c := call.match(body, at)) is not None:
                name, args = c.group("name"), c.group("args")
                if name not in tools:
                    return text, []
                values, covered = {}, 0
                for p in param.finditer(args):
                    if p.start() != covered:
                        return text, []
                    schema = (tools[name] or {}).get("properties", {}).get(p.group("key"), {})
                    values[p.group("key")] = _value(p.group("value"), p.groupdict().get("string"), schema)
                    covered = p.end()
                if args[covered:].strip():
                    return text, []
                calls.append(ToolCall.new(name, values))
                at = c.end()
            if body[at:].strip():
                return text, []
            pos = s.end()
        return (text[:start], calls) if calls else (text, [])

    def grammar(self, tools: list[dict], only: str | None, special_ids: dict[str, int], parallel: bool = True) -> str:
        rules = []
        for k, fn in enumerate(functions(tools, only)):
            props, required = arguments(fn)
            items = []
            for j, (key, prop) in enumerate(props.items()):
                bare = is_string(prop)
                opened = self.param_open.replace("{key}", key).replace("{string}", "true" if bare else "false")
                value = raw_string(prop, self.param_close, f"{fn['name']}.{key}", f"TEXT{k}_{j}", rules) if bare \
                    else f"{json_value(prop)} {lark_text(self.param_close, special_ids)}"
                rules.append(f"arg{k}_{j}: {lark_text(opened, special_ids)} {value}")
                items.append(f"arg{k}_{j}")
            args = sequence(items, required, "")
            opened = lark_text(self.call_open.replace("{name}", fn["name"]), special_ids)
            rules.append(f"call{k}: {opened} {args} {lark_text(self.call_close, special_ids)}".rstrip())
        names = " | ".join(f"call{k}" for k in range(len(functions(tools, only))))
        marker, end = lark_text(self.marker, special_ids), lark_text(self.section_end, special_ids)
        if self.calls_per_section == 1:
            head = f'start: section{"+" if parallel else ""}\nsection: {marker} call {end} "\\n"?\n'
        else:
            head = f"start: {marker} call{'+' if parallel else ''} {end}\n"
        return head + f"call: {names}\n" + "\n".join(rules) + "\n"


def _value(raw: str, string: str | None, schema: dict):
    if string == "true":
        return raw
    if string == "false":
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return coerce(raw, schema)


_FUNCTION_CALL = dict(call_open="\n<function={name}>\n", call_close="</function>\n")
SYNTAXES = {
    "qwen3_coder": TaggedSyntax("qwen3_coder", "<tool_call>", "</tool_call>", **_FUNCTION_CALL,
                                param_open="<parameter={key}>\n", param_close="\n</parameter>\n"),
    "seed_oss": TaggedSyntax("seed_oss", "<seed:tool_call>", "</seed:tool_call>", **_FUNCTION_CALL,
                             param_open="<parameter={key}>", param_close="</parameter>\n"),
    "glm45": TaggedSyntax("glm45", "<tool_call>", "</tool_call>", "{name}\n", "",
                          "<arg_key>{key}</arg_key>\n<arg_value>", "</arg_value>\n"),
    "glm47": TaggedSyntax("glm47", "<tool_call>", "</tool_call>", "{name}", "", "<arg_key>{key}</arg_key><arg_value>",
                          "</arg_value>"),
    "minimax_m2": TaggedSyntax("minimax_m2", "<minimax:tool_call>", "</minimax:tool_call>",
                               '\n<invoke name="{name}">\n', "</invoke>\n", '<parameter name="{key}">',
                               "</parameter>\n", calls_per_section=0),
    "deepseek_v32": TaggedSyntax("deepseek_v32", "<｜DSML｜function_calls>", "</｜DSML｜function_calls>",
                                 '\n<｜DSML｜invoke name="{name}">\n', "</｜DSML｜invoke>\n",
                                 '<｜DSML｜parameter name="{key}" string="{string}">', "</｜DSML｜parameter>\n",
                                 calls_per_section=0),
}
