"""Makes PEFT LoRA adapters for a base checkpoint (default: the shipped SmolLM2-135M-Instruct), one
sub-directory of --out per name, for multi-LoRA tests and benchmarks (README "LoRA adapters",
docs/BENCHMARKS.md "Multi-LoRA"). The work is client/orca_client/lora_adapters.py's make_adapters; its
docstring describes the two inits:

    python scripts/make_lora_adapters.py --out /tmp/loras --names a,b                   # random, fast
    python scripts/make_lora_adapters.py --out /tmp/loras --names a,b --init fitted     # ~1 min on 2 cores

then, e.g., ``EngineConfig(enable_lora=True, lora_modules="a=/tmp/loras/a,b=/tmp/loras/b")``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "client")]  # this checkout's orca and orca_client

from orca_client.lora_adapters import INITS, RANDOM_SCALE, make_adapters  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="base checkpoint: a Hugging Face directory or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, metavar="DIR", help="adapters go to DIR/<name>")
    p.add_argument("--names", default="a,b", help="adapter names, comma-separated (default: %(default)s)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank r (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=None, help="lora_alpha (default: 2 x rank)")
    p.add_argument("--targets", default=None,
                   help="target modules, comma-separated (default: q_proj,v_proj; c_attn for GPT-2)")
    p.add_argument("--seed", type=int, default=0, help="adapter i's seed is SEED + i (default: %(default)s)")
    p.add_argument("--init", choices=INITS, default="random",
                   help="random: PEFT's init_lora_weights=False, B scaled (--scale); fitted: a short fine-tune "
                        "on its own slice of pydoc_data.topics (default: %(default)s)")
    p.add_argument("--scale", type=float, default=RANDOM_SCALE,
                   help="random: each layer's delta s B A gets this times its base weight's Frobenius norm "
                        "(default: %(default)s)")
    p.add_argument("--steps", type=int, default=32, help="fitted: AdamW steps per adapter (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=16, help="fitted: tokens per sequence (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=2, help="fitted: sequences per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-3, help="fitted: AdamW's learning rate (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", metavar="PATH", help="write each adapter's record (losses included) to this file")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.names.split(",") if n.strip()]
    targets = [t.strip() for t in args.targets.split(",") if t.strip()] if args.targets else None
    try:
        records = make_adapters(args.out, names, args.model, rank=args.rank, alpha=args.alpha, targets=targets,
                                seed=args.seed, init=args.init, scale=args.scale, steps=args.steps,
                                seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, threads=args.threads)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
    print("lora_modules=" + ",".join(f"{r['name']}={r['path']}" for r in records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
