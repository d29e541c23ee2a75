"""`pdsdk model tiny --out DIR`: make the small local model the CPU tests and demo serve."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("model", help="make models for tests and demos (no downloads)")
    model_sub = p.add_subparsers(dest="model_command", metavar="KIND", required=True)
    tiny = model_sub.add_parser("tiny", help="deterministic random-weight Llama with a locally trained tokenizer")
    tiny.add_argument("--out", required=True, help="folder to write (created if missing)")
    tiny.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    tiny.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    tiny.add_argument("--heads", type=int, default=4, help="attention heads (default 4: head_dim 32)")
    tiny.add_argument("--kv-heads", type=int, default=2, help="KV heads (default 2)")
    tiny.add_argument("--vocab", type=int, default=512, help="tokenizer vocabulary (default 512)")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    tiny.set_defaults(func=run_tiny)


def run_tiny(args) -> int:
    from pdsdk.tinymodel import make_tiny_model

    out = make_tiny_model(args.out, layers=args.layers, hidden=args.hidden, heads=args.heads,
                          kv_heads=args.kv_heads, vocab=args.vocab, seed=args.seed)
    print(f"wrote {out}: serve it with --model {out} (CPU: --block-size 32 or another multiple of 32)")
    return 0
