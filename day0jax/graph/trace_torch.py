"""Traces a Hugging Face model's forward pass with the `transformers` of the Python running it; prints JSON.

Run by path with another Python (one that has torch and transformers): the runtime never imports this file, nor
torch. `python trace_torch.py JOBS.json` where JOBS.json is a list of jobs `{"path": FOLDER, "families": [model_type,
...], "tokens": T, "shrink_above": N}`; prints a JSON list with one result per job, in order. A job never raises:
where tracing stops, the result says at which stage, with the error and the modeling code's file:line.

Per job:
1. the config from FOLDER/config.json alone (no weights are read);
2. the module tree of the true config on the meta device: each module's class and its own parameter count (and how
   much of it one token reads, for expert weights stacked over the experts);
3. one forward pass over T tokens with random weights on the CPU, recording each module class's calls (forward
   hooks) and the torch functions called directly in it (a TorchFunctionMode). Configs above `shrink_above`
   parameters are traced shrunk (fewer layers, experts, narrower widths; the same layer types), and the runtime
   scales the calls back by the true config's instances of each class;
4. for each family named in `families`, the module classes its modeling file defines (for the nearest family).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import re
import sys
import time
import traceback
from collections import Counter, defaultdict

import torch
from torch.overrides import TorchFunctionMode

# Words that mark a module class as part of another modality's tower, left out of a text model's structure.
OTHER_MODALITIES = ("Vision", "Visual", "Audio", "Video", "Image", "Patch", "Projector", "MultiModal", "Multimodal")
EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
TOPK_KEYS = ("num_experts_per_tok", "moe_k", "top_k", "moe_topk")


@functools.cache
def _lines(path: str) -> list[str]:
    with open(path) as f:
        return f.read().splitlines()


@functools.cache
def where(cls) -> dict:
    """The file and line of a class's definition (None where Python cannot find them); a scan of the file for its
    `class` line, since `inspect.getsourcelines` parses the whole file again for each class."""
    try:
        path = inspect.getsourcefile(cls)
    except TypeError:
        return {"file": None, "line": None}
    pattern = re.compile(rf"\s*class {re.escape(cls.__name__)}\b")
    line = next((i + 1 for i, text in enumerate(_lines(path)) if pattern.match(text)), None) if path else None
    return {"file": path, "line": line}


def load_config(folder: str):
    import os

    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(folder, "config.json")):  # else transformers reads it as a Hub repo id
        raise FileNotFoundError(f"no config.json in {folder}")

    return AutoConfig.from_pretrained(folder, local_files_only=True)


def model_class(config):
    """The class a causal LM of `config` is built with, and whether it is the multimodal model (no text-only class).

    A multimodal config's text config is traced where transformers has a causal LM (or a base model) for it."""
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM

    def causal(cfg):
        if type(cfg) in AutoModelForCausalLM._model_mapping:
            return AutoModelForCausalLM._model_mapping[type(cfg)]
        own = getattr(transformers, type(cfg).__name__.removesuffix("Config") + "ForCausalLM", None)
        return own

    multimodal = any(getattr(config, k, None) is not None for k in ("vision_config", "audio_config"))
    text = config.get_text_config() if multimodal else config
    cls = causal(text)
    if cls is None and type(text) in AutoModel._model_mapping:
        cls = AutoModel._model_mapping[type(text)]
    if cls is None:  # the text model exists only inside the multimodal one
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText._model_mapping[type(config)], config, True
    return cls, text, multimodal


def experts_of(config) -> tuple[int | None, int | None]:
    count = next((getattr(config, k) for k in EXPERT_COUNT_KEYS if isinstance(getattr(config, k, None), int)), None)
    topk = next((getattr(config, k) for k in TOPK_KEYS if isinstance(getattr(config, k, None), int)), None)
    return count, topk


def module_tree(model, config) -> list[list]:
    """[path, class, own parameters, own parameters one token reads]: stacked expert weights (first dimension the
    number of experts) count top-k of E."""
    count, topk = experts_of(config)
    rows = []
    for path, m in model.named_modules():
        own = active = 0
        for p in m.parameters(recurse=False):
            n = p.numel()
            own += n
            stacked = count and topk and p.dim() >= 3 and p.shape[0] == count
            active += n * topk // count if stacked else n
        if isinstance(m, torch.nn.Embedding):  # a lookup reads one row per token
            active = m.embedding_dim
        rows.append([path, type(m).__name__, own, active])
    return rows


def per_layer_lists(config) -> list[str]:
    """The config's keys holding one entry per layer (`layer_types`, `mlp_layer_types`...)."""
    n = getattr(config, "num_hidden_layers", None)
    return [k for k, v in vars(config).items() if isinstance(v, list) and n and len(v) == n]


def shrink(config):
    """A copy of `config` with the same layer types, few layers, few experts and narrow widths: one layer of each
    distinct combination of the per-layer lists (`layer_types`, `mlp_layer_types`...), at most 8 layers."""
    small = copy.deepcopy(config)
    n = getattr(config, "num_hidden_layers", None)
    lists = per_layer_lists(config)
    if n:
        seen, keep = set(), []
        for i in range(n):
            key = tuple(json.dumps(getattr(config, k)[i]) for k in lists)
            if key not in seen:
                seen.add(key)
                keep.append(i)
        keep = keep[:8] or [0]
        if not lists:  # no per-layer list: dense-then-sparse patterns (first_k_dense_replace) need a few layers
            keep = list(range(min(n, 4)))
        for k in lists:
            setattr(small, k, [getattr(config, k)[i] for i in keep])
        small.num_hidden_layers = len(keep)
    count, topk = experts_of(config)
    if count and count > 8:
        for k in EXPERT_COUNT_KEYS:
            if isinstance(getattr(small, k, None), int):
                setattr(small, k, 8)
        for k in TOPK_KEYS:
            if isinstance(getattr(small, k, None), int):
                setattr(small, k, min(getattr(small, k), 2))
        for k in ("n_group", "topk_group"):
            if isinstance(getattr(small, k, None), int):
                setattr(small, k, 1)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if hidden and heads and getattr(config, "head_dim", None) is None:
        small.head_dim = hidden // heads  # kept: narrowing the model must not narrow the heads
    for k, v in vars(config).items():
        if isinstance(v, int) and not isinstance(v, bool) and v > 256 and (
                k == "hidden_size" or k.endswith("intermediate_size") or k == "vocab_size"):
            setattr(small, k, 256)
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):  # ids past the narrowed vocabulary
        v = getattr(small, k, None)
        if isinstance(v, int) and v >= small.vocab_size:
            setattr(small, k, None if k == "pad_token_id" else 0)
    return small


class Recorder(TorchFunctionMode):
    """Counts the torch functions called directly inside each module class (the innermost module running)."""

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.ops: dict[str, Counter] = defaultdict(Counter)
        self.calls: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.stack:
            name = getattr(func, "__name__", None) or str(func)
            if not name.startswith("__get") and name not in ("size", "dim", "shape", "__get__", "__set__"):
                self.ops[self.stack[-1]][name] += 1
        return func(*args, **(kwargs or {}))

    def attach(self, model) -> None:
        for m in model.modules():
            m.register_forward_pre_hook(self._enter)
            m.register_forward_hook(self._leave)

    def _enter(self, module, args):
        name = type(module).__name__
        self.stack.append(name)
        self.calls[name] += 1

    def _leave(self, module, args, output):
        self.stack.pop()


def stop(stage: str, error: BaseException, stack: list[str] | None = None) -> dict:
    """Where tracing stopped: the stage, the error, the innermost frame in modeling code and the module running."""
    frames = traceback.extract_tb(error.__traceback__)
    inside = [f for f in frames if "/transformers/" in f.filename] or frames
    frame = inside[-1] if inside else None
    return {"stage": stage, "error": f"{type(error).__name__}: {error}"[:500],
            "file": frame.filename if frame else None, "line": frame.lineno if frame else None,
            "module": stack[-1] if stack else None}


def family_classes(model_type: str) -> list[dict] | None:
    """The module classes the modeling file of `model_type` defines (text model only), None if transformers lacks it."""
    import importlib

    from transformers import CONFIG_MAPPING

    try:
        config_cls = CONFIG_MAPPING[model_type]
        try:
            module = importlib.import_module(config_cls.__module__.replace(".configuration_", ".modeling_"))
        except ModuleNotFoundError:  # a family run by another's classes (EXAONE by Llama's)
            cls, _, _ = model_class(config_cls())
            module = importlib.import_module(cls.__module__)
    except Exception:  # noqa: BLE001 - a family transformers lacks or cannot import: left out of the comparison
        return None
    out = []
    for name, obj in vars(module).items():
        if (inspect.isclass(obj) and issubclass(obj, torch.nn.Module) and obj.__module__ == module.__name__
                and not any(w in name for w in OTHER_MODALITIES)):
            out.append(name)
    return sorted(out)


def prefixes(config, cls) -> list[str]:
    """The class-name prefixes of the model's own classes, longest first ('Glm5NextText', 'Glm5Next')."""
    names = {type(config).__name__.removesuffix("Config")}
    for suffix in ("ForCausalLM", "ForConditionalGeneration", "TextModel", "Model"):
        if cls.__name__.endswith(suffix):
            names.add(cls.__name__.removesuffix(suffix))
            break
    return sorted({n for n in names if n}, key=len, reverse=True)


def trace(job: dict) -> dict:
    import transformers

    result = {"path": job["path"], "transformers": transformers.__version__, "stopped": None}
    try:
        config = load_config(job["path"])
    except Exception as e:  # noqa: BLE001 - reported: a model_type this transformers lacks, a malformed config
        result["stopped"] = stop("reading config.json with transformers " + transformers.__version__, e)
        return result
    result["model_type"] = config.model_type
    try:
        cls, text, multimodal = model_class(config)
    except Exception as e:  # noqa: BLE001
        result["stopped"] = stop("finding the model class", e)
        return result
    result.update(model_class=cls.__name__, multimodal=multimodal, text_model_type=text.model_type,
                  modeling_file=where(cls)["file"], prefixes=prefixes(text, cls))
    try:
        with torch.device("meta"):
            full = cls._from_config(text)
        result["tree"] = module_tree(full, text)
        result["sources"] = {cls.__name__: where(cls) for cls in {type(m) for m in full.modules()}}
        del full
    except Exception as e:  # noqa: BLE001
        result["stopped"] = stop("building the model on the meta device", e)
        return result
    params = sum(row[2] for row in result["tree"])
    small = shrink(text) if params > job.get("shrink_above", 5e7) else text
    result["shrunk"] = small is not text
    recorder = Recorder()
    try:
        torch.manual_seed(0)
        model = cls._from_config(small).eval()
        recorder.attach(model)
        result["traced_instances"] = dict(Counter(type(m).__name__ for m in model.modules()))
        result["sources"].update({cls.__name__: where(cls) for cls in {type(m) for m in model.modules()}})
    except Exception as e:  # noqa: BLE001
        result["stopped"] = stop("building the model with random weights", e)
        return result
    vocab = getattr(small, "vocab_size", 256) or 256
    tokens = job.get("tokens", 8)
    ids = torch.tensor([[1 + (7 * i + 3) % max(vocab - 2, 1) for i in range(tokens)]])
    try:
        with torch.no_grad(), recorder:
            model(input_ids=ids)
    except Exception as e:  # noqa: BLE001
        result["stopped"] = stop("the forward pass", e, recorder.stack)
    result["tokens"] = tokens
    result["calls"] = dict(recorder.calls)
    result["ops"] = {k: dict(v) for k, v in recorder.ops.items()}
    return result


def main(argv: list[str]) -> int:
    jobs = json.load(open(argv[1]))
    out = []
    family_cache: dict[str, list | None] = {}
    for job in jobs:
        start = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):  # transformers' warnings must not mix with the JSON
            result = trace(job)
            families = {}
            for mt in job.get("families", ()) if result.get("model_type") else ():  # nothing to compare otherwise
                if mt not in family_cache:
                    family_cache[mt] = family_classes(mt)
                if family_cache[mt] is not None:
                    families[mt] = family_cache[mt]
            result["families"] = families
        result["seconds"] = round(time.perf_counter() - start, 3)
        out.append(result)
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
