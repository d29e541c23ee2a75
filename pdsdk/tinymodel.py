"""`pdsdk model tiny`: a deterministic random-weight Llama with a real tokenizer, made offline.

No model can be downloaded on the development machines and CI, yet vLLM must serve something real.
This writes a Hugging Face model folder (config.json, model.safetensors, tokenizer.json, chat
template) whose byte-level BPE tokenizer is trained locally with `tokenizers`. Sized for 2 CPU cores;
the CPU attention backend needs head_dim 32/64/80/... and block sizes that are multiples of 32.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CORPUS = """\
Prefill and decode run on different workers. The prefill worker reads the whole prompt and writes the
key value cache; the decode worker reads those pages and produces one token at a time. A router sends
each request to a pair of workers, and a transport moves the pages between them. Stores keep pages for
later requests that share a prefix: the system prompt, the tool definitions, the history of a session.
The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 10 100 1000 2026 3.14 42!?,.;:'"()[]{}
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris is.
def main(): return sum(x * x for x in range(10))  # code, too
"""

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tiny_model(out: str | Path, *, layers: int = 2, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
                    vocab: int = 512, max_positions: int = 2048, seed: int = 0) -> Path:
    """Write the model folder and return its path. Same arguments, same bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    head_dim = hidden // heads
    if head_dim not in (32, 64, 80, 96, 112, 128, 256):
        raise ValueError(f"hidden/heads = {head_dim}: vLLM's CPU attention needs head_dim 32, 64, 80, ...")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    specials = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS.splitlines() * 4, trainer=trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    vocab_size = tokenizer.get_vocab_size()
    eos = tokenizer.token_to_id("<|endoftext|>")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": None,
        "pad_token": "<|endoftext|>", "model_max_length": max_positions, "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": hidden * 2, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab_size,
        "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": eos, "eos_token_id": eos,
    }, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    _write_weights(out / "model.safetensors", layers, hidden, heads, kv_heads, head_dim, vocab_size, seed)
    return out


def _write_weights(path: Path, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                   vocab: int, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    rng = np.random.default_rng(seed)
    inter = hidden * 2

    def w(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return torch.from_numpy(rng.normal(0.0, scale, size=shape).astype(np.float32)).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": w(vocab, hidden, scale=0.5), "lm_head.weight": w(vocab, hidden, scale=0.5),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        })
    save_file(tensors, str(path), metadata={"format": "pt"})
