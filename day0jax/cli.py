"""Command-line flags shared by `day0jax.serve`, `day0jax.compile` and `day0jax.generate`.

The engine's shape flags live here once, so `compile` given the server's flags compiles exactly the server's programs.
"""

from __future__ import annotations

import argparse

from kernels_pallas.registry import MODES as KERNEL_MODES


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --mesh, --dtype, --kernels, --load-concurrency."""
    p.add_argument("--model", help="day0jax checkpoint folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--mesh", help="device mesh SPEC, e.g. 'tp=2' or 'dp=2,tp=4', or 'auto' (default: one device)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: per backend")
    p.add_argument("--kernels", choices=KERNEL_MODES, default="auto",
                   help="'auto': Pallas kernels checked against their references at load, falling back per op; "
                        "'strict': a disagreeing kernel is an error; 'reference': no kernels (default auto)")
    p.add_argument("--load-concurrency", type=load_concurrency, metavar="BYTES",
                   help="checkpoint bytes read but not yet on their devices, at most, e.g. 512MiB (default: a "
                        "sixteenth of the available memory, between 64 MiB and 2 GiB)")


def load_concurrency(text: str) -> int:
    """argparse type of --load-concurrency: a size such as 512MiB, 1GB or a plain number of bytes."""
    from day0jax.core.errors import MeshError
    from sharding.cluster import UNITS, parse_size

    try:
        n = parse_size(text)
    except MeshError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size of at least one byte such as 512MiB or 2GB "
                                         f"(units: {', '.join(u for u in UNITS if u)})")
    return n


def add_compile_cache_arguments(p: argparse.ArgumentParser) -> None:
    """--compile-cache DIR / --no-compile-cache."""
    g = p.add_argument_group("compilation cache")
    g.add_argument("--compile-cache", metavar="DIR",
                   help="persistent compilation cache root (default: ~/.cache/day0jax/compile); a subfolder per "
                        "jax version, backend, mesh and model")
    g.add_argument("--no-compile-cache", action="store_true", help="compile everything, read and write no cache")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine's shape and scheduling flags (`EngineConfig`)."""
    g = p.add_argument_group("engine")
    g.add_argument("--max-model-len", type=int, help="longest prompt + output (default: the model's context)")
    g.add_argument("--max-num-seqs", type=int, default=16, help="most sequences decoded together")
    g.add_argument("--kv-cache-tokens", type=int, help="KV pool capacity in tokens")
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--chunk-sizes", default="32,256", help="prefill chunk lengths compiled, comma separated")
    g.add_argument("--min-width", type=int, default=128,
                   help="smallest attention span (tokens) compiled for decode; spans double up to 1024, then 4x")
    g.add_argument("--max-waiting", type=int, default=256, help="queued sequences before answering 429")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--image-cache-mb", type=int, default=256,
                   help="host memory for the features of encoded images, so that an image sent again is not "
                        "encoded again (vision-language models; 0: off)")
    g.add_argument("--no-window-kv", action="store_true",
                   help="sliding-window layers keep every page, not only their window's (keeps prefix caching on)")
    g.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="KV cache storage: 'auto' the model's dtype; 'fp8' float8_e4m3fn with a float32 scale per "
                        "token and kv head, about half of bfloat16's memory (twice the context)")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative", choices=["mtp", "ngram", "draft"],
                   help="draft tokens and verify them in one step: 'mtp' the model's multi-token-prediction layers, "
                        "'ngram' prompt lookup in the request's own tokens, 'draft' a smaller model (--draft-model)")
    s.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="tokens drafted per sequence and step (default 4)")
    s.add_argument("--draft-model", metavar="PATH", help="the draft model's day0jax checkpoint (same tokenizer)")
    s.add_argument("--ngram-min", type=int, default=2, help="shortest n-gram the ngram proposer matches")
    s.add_argument("--ngram-max", type=int, default=4, help="longest n-gram the ngram proposer matches")
    s.add_argument("--spec-max-batch", type=int, default=None, metavar="B",
                   help="speculation turns off while more sequences than this decode together (default: "
                        "measured, see README)")
    from day0jax.engine.config import MAX_LORA_RANK, MAX_LORAS

    a = p.add_argument_group("LoRA adapters")
    a.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="PEFT LoRA adapter folders served beside the model; a request's `model` names one")
    a.add_argument("--enable-lora", action="store_true",
                   help="accepted for vLLM's command lines: --lora-modules alone turns adapters on")
    a.add_argument("--max-loras", type=int, default=MAX_LORAS, help="most adapters served")
    a.add_argument("--max-lora-rank", type=int, default=MAX_LORA_RANK, help="largest adapter rank accepted")


def add_warmup_arguments(p: argparse.ArgumentParser) -> None:
    """How many of the engine's programs to compile before serving, and with how many threads."""
    g = p.add_argument_group("warm-up")
    g.add_argument("--warmup-max-len", type=int, default=0,
                   help="compile before serving only the forward programs for spans up to this many tokens, "
                        "the rest on first use (faster cold start, slower first long request); default 0: all")
    g.add_argument("--compile-workers", type=int, default=None,
                   help="threads compiling programs in parallel (default: one per core, at most 8)")


def engine_config_from_args(args: argparse.Namespace):
    """The `EngineConfig` the engine flags describe."""
    from day0jax.engine.config import EngineConfig

    try:
        chunks = tuple(int(x) for x in args.chunk_sizes.split(","))
    except ValueError:
        raise SystemExit(f"--chunk-sizes {args.chunk_sizes!r}: expected comma-separated integers, e.g. 32,256")
    return EngineConfig(page_size=args.page_size, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        kv_cache_tokens=args.kv_cache_tokens, max_waiting=args.max_waiting, chunk_buckets=chunks,
                        min_width=args.min_width, prefix_caching=not args.no_prefix_caching,
                        window_kv=not args.no_window_kv, speculative=speculative_config_from_args(args),
                        image_cache_mb=args.image_cache_mb, kv_cache_dtype=args.kv_cache_dtype,
                        lora_modules=lora_modules_from_args(args), max_loras=args.max_loras,
                        max_lora_rank=args.max_lora_rank)


def lora_modules_from_args(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """--lora-modules NAME=PATH ... as (name, path) pairs."""
    pairs = []
    for item in args.lora_modules:
        name, eq, path = item.partition("=")
        if not eq or not name or not path:
            raise SystemExit(f"--lora-modules {item!r}: expected NAME=PATH (the adapter's name and its PEFT folder)")
        pairs.append((name, path))
    return tuple(pairs)


def speculative_config_from_args(args: argparse.Namespace):
    """The `SpeculativeConfig` the speculative flags describe (None without --speculative)."""
    from day0jax.engine.config import SpeculativeConfig

    method = getattr(args, "speculative", None)
    if method is None:
        if getattr(args, "draft_model", None) or getattr(args, "num_speculative_tokens", None):
            raise SystemExit("--draft-model and --num-speculative-tokens need --speculative")
        return None
    if method == "draft" and not args.draft_model:
        raise SystemExit("--speculative draft needs --draft-model PATH")
    return SpeculativeConfig(method, num_tokens=args.num_speculative_tokens or 4, ngram_min=args.ngram_min,
                             ngram_max=args.ngram_max, draft_model=args.draft_model, max_batch=args.spec_max_batch)
