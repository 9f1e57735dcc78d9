"""`python -m day0jax.train --model CKPT --data DIR --adapter-path OUT [...]`: LoRA fine-tuning (mlx-lm's flags and
jsonl formats), the adapter written in PEFT's format. See `day0jax.train.cli`."""

import sys

from day0jax.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
