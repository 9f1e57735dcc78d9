"""`python -m convert SRC DST [--dtype bfloat16|float32] [--quantize int8|int4|fp8|mxfp4|nvfp4 [--group-size N]]
[--dequantize] [--no-mtp] [--force]`, `python -m convert --verify DST` and `python -m convert --export-hf CKPT OUT
[--force]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from convert.convert import Options, convert_checkpoint
from convert.export_hf import export_hf
from convert.verify import verify_checkpoint
from day0jax.core import logs
from day0jax.core.errors import Day0Error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m convert",
                                     description="Convert a Hugging Face folder or a GGUF file into a day0jax "
                                                 "checkpoint, verify one, or export one back as a Hugging Face "
                                                 "folder.")
    parser.add_argument("src", type=Path, nargs="?", help="Hugging Face model folder or .gguf file")
    parser.add_argument("dst", type=Path, nargs="?", help="checkpoint folder to create")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="parameter dtype (default: the source's own; float32 for GGUF)")
    parser.add_argument("--quantize", choices=["int8", "int4", "fp8", "mxfp4", "nvfp4"],
                        help="store a float source's linear weights quantized (round to nearest, one scale per "
                             "group; mxfp4: OCP MX blocks of 32 with E8M0 scales; nvfp4: blocks of 16 with e4m3 "
                             "scales and a global one; embeddings int8 with the 4-bit kinds; norms, routers and "
                             "vision towers stay float)")
    parser.add_argument("--group-size", type=int, metavar="N",
                        help="inputs per scale with --quantize (default: 32 for int8/int4, 128 for fp8; "
                             "mxfp4 and nvfp4 have their own, 32 and 16)")
    parser.add_argument("--dequantize", action="store_true",
                        help="store a quantized source (GGUF, FP8) as float instead of keeping it quantized")
    parser.add_argument("--no-mtp", action="store_true",
                        help="leave out the multi-token-prediction layers a checkpoint ships (kept by default: "
                             "speculative decoding's 'mtp' proposer runs them)")
    parser.add_argument("--workers", type=int, metavar="N",
                        help="threads writing, hashing and syncing the checkpoint's files (default: twice the cores, "
                             "8 to 16)")
    parser.add_argument("--force", action="store_true",
                        help="replace DST if it is a day0jax checkpoint or an empty folder")
    parser.add_argument("--verify", type=Path, metavar="DST", help="check a checkpoint against its manifest")
    parser.add_argument("--export-hf", action="store_true",
                        help="SRC is a day0jax checkpoint (a conversion or a full fine-tuning's output): write it "
                             "to DST as a Hugging Face folder (safetensors in transformers' names and layouts, "
                             "config, tokenizer)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    logs.setup("warning" if args.quiet else "info")
    try:
        if args.verify:
            problems = verify_checkpoint(args.verify)
            if problems:
                for p in problems:
                    print(f"FAIL {p}", file=sys.stderr)
                return 1
            print(f"OK {args.verify}: every file matches the manifest")
            return 0
        if args.src is None or args.dst is None:
            parser.error("SRC and DST are required (or --verify DST)")
        if args.export_hf:
            given = [f for f, v in (("--dtype", args.dtype), ("--quantize", args.quantize),
                                    ("--group-size", args.group_size), ("--dequantize", args.dequantize),
                                    ("--no-mtp", args.no_mtp), ("--workers", args.workers)) if v]
            if given:
                parser.error(f"--export-hf writes the checkpoint as it is stored: {given[0]} does not apply")
            print(export_hf(args.src, args.dst, force=args.force, progress=not args.quiet))
            return 0
        if args.workers is not None and args.workers < 1:
            parser.error("--workers must be at least 1")
        if args.group_size is not None and not args.quantize:
            parser.error("--group-size needs --quantize")
        options = Options(dtype=args.dtype, quantize=args.quantize, group_size=args.group_size,
                          dequantize=args.dequantize, no_mtp=args.no_mtp, workers=args.workers)
        print(convert_checkpoint(args.src, args.dst, force=args.force, progress=not args.quiet, options=options))
        return 0
    except Day0Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
