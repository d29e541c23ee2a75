"""GPU machine: a Qwen3-8B-shaped model folder with seeded random weights and pdsdk's tiny tokenizer.

`--load-format dummy` weights are so small that every logit is nearly equal, so greedy outputs are
decided by rounding noise and a PD-vs-single comparison says nothing. These weights make the
logits peaked (lm_head rows beyond the tokenizer's vocabulary are zero, so every generated id is one
the tokenizer can print). Usage: python3 tests/gpu/qwen3_model.py OUT_DIR [--config-only]
"""

import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdsdk.tinymodel import make_tiny_model

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 36, 4096, 32, 8, 128, 12288, 151936


def main(out: Path, config_only: bool = False) -> None:
    if (out / "done").exists():
        return
    start = time.time()
    tiny = make_tiny_model(out / "tokenizer-src")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_text((tiny / name).read_text())
    tok_vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    eos = json.loads((tiny / "generation_config.json").read_text())["eos_token_id"]
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu", "attention_bias": False,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": eos, "eos_token_id": eos}, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    if config_only:  # `--load-format dummy`: every id printable, so the vocabulary is the tokenizer's (KV unchanged)
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "vocab_size": tok_vocab}, indent=2))
        (out / "done").write_text("config only\n")
        return
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(*shape, std=0.02):
        return (torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32) * std).to(torch.bfloat16)

    ones = lambda n: torch.ones(n, dtype=torch.bfloat16, device="cuda")  # noqa: E731
    head = w(VOCAB, HIDDEN, std=0.15)
    head[tok_vocab:] = 0
    save_file({"model.embed_tokens.weight": w(VOCAB, HIDDEN, std=1.0).cpu(), "lm_head.weight": head.cpu(),
               "model.norm.weight": ones(HIDDEN).cpu()}, str(out / "model-head.safetensors"), metadata={"format": "pt"})
    for first in range(0, LAYERS, 6):
        tensors = {}
        for i in range(first, min(first + 6, LAYERS)):
            p = f"model.layers.{i}."
            tensors.update({
                p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
                p + "self_attn.q_norm.weight": ones(HEAD_DIM), p + "self_attn.k_norm.weight": ones(HEAD_DIM),
                p + "mlp.gate_proj.weight": w(INTER, HIDDEN), p + "mlp.up_proj.weight": w(INTER, HIDDEN),
                p + "mlp.down_proj.weight": w(HIDDEN, INTER),
                p + "input_layernorm.weight": ones(HIDDEN), p + "post_attention_layernorm.weight": ones(HIDDEN)})
        save_file({k: v.cpu() for k, v in tensors.items()}, str(out / f"model-{first:02d}.safetensors"),
                  metadata={"format": "pt"})
    (out / "done").write_text(f"{time.time() - start:.1f}\n")
    print(f"model written to {out} in {time.time() - start:.1f} s (tokenizer vocabulary {tok_vocab})")


if __name__ == "__main__":
    main(Path(sys.argv[1]), config_only="--config-only" in sys.argv[2:])
