"""`python -m day0jax.generate`: generate text from a prompt with a converted checkpoint or the default model.

Without `--model` it uses the embedded SmolLM2-135M-Instruct (converted on first use); `--chat` applies the
checkpoint's chat template. Compiled programs are kept in the compilation cache, so a second run compiles nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from day0jax import cli
from day0jax.core import logs
from day0jax.core.errors import Day0Error
from sharding import distributed


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m day0jax.generate", description=__doc__.splitlines()[0])
    cli.add_model_arguments(p)  # --model, --mesh, --dtype, --kernels, as serve and compile take them
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="apply the checkpoint's chat template to the prompt")
    p.add_argument("--system", default=None, help="a system message (with --chat)")
    p.add_argument("--adapter", metavar="NAME", help="generate with this LoRA adapter of --lora-modules")
    logs.add_argument(p, default="warning")
    p.add_argument("-v", "--verbose", action="store_const", dest="log_level", const="info",
                   help="log the steps (the same as --log-level info)")
    cli.add_compile_cache_arguments(p)
    cli.add_engine_arguments(p)  # the engine generate runs on, as the server's
    distributed.add_arguments(p)  # --coordinator/--num-processes/--process-id: one mesh over several hosts
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.setup(args.log_level)
    t0 = time.perf_counter()
    try:
        distributed.initialize_from_args(args)  # before anything touches a device; no-op without a coordinator
        import jax

        import day0jax
        from day0jax.default_model import default_checkpoint
        from day0jax.loader import default_dtype
        from day0jax.startup.compile_cache import model_fingerprint
        from day0jax.startup.program_store import ProgramStore
        from day0jax.start import enable_cache
        from day0jax.startup.timeline import null

        path = Path(args.model) if args.model else default_checkpoint()
        dtype = args.dtype or default_dtype()
        # Before the first compile; warns and goes on if unusable.
        cache = enable_cache(args, model_fingerprint(path, dtype), null())
        model = day0jax.load(path, dtype=dtype, mesh=args.mesh, engine=cli.engine_config_from_args(args),
                             kernels=args.kernels, load_concurrency=args.load_concurrency)
        if cache is not None and jax.process_count() == 1:  # a warm second run traces nothing either
            model.program_store = ProgramStore(cache)
        t_load = time.perf_counter()
        if model.tokenizer is None:
            raise day0jax.core.errors.CheckpointError(f"{path}: no tokenizer.json, so text prompts cannot be encoded")
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                [{"role": "user", "content": args.prompt}]
            ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        else:
            ids = model.tokenizer.encode(args.prompt)
        out = model.generate([ids], args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                             top_k=args.top_k, seed=args.seed, adapter=args.adapter)[0]
        t_gen = time.perf_counter()
    except Day0Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text_ids = [t for t in out if t not in model.eos_token_ids]
    print(model.tokenizer.decode(text_ids, skip_special_tokens=True))
    # Generation time includes compiling the bucketed prefill/decode programs on first use.
    print(f"[{len(ids)} prompt tokens, {len(out)} new; load {t_load - t0:.1f}s, generate {t_gen - t_load:.1f}s "
          f"({len(out) / max(t_gen - t_load, 1e-9):.1f} tokens/s incl. compile)]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
