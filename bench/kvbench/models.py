"""Random-weight Llama-architecture models of a given shape, written as Hugging Face folders
(bf16 safetensors with N(0, 0.02) weights and norms at 1, config.json, a byte-level
tokenizer.json with no merges: one token per byte), for the speed and memory benchmarks, where
only the shapes matter."""
import json
import pathlib

import numpy as np


def write_random_1b(folder: pathlib.Path) -> None:
    """Writes a Llama-3.2-1B-shaped model with N(0, 0.02) bf16 weights (norms at 1)."""
    write_random_model(folder, hidden=2048, inner=8192, layers=16, heads=32, kv_heads=8,
                       head_dim=64, vocab=128256)


def write_random_model(folder: pathlib.Path, hidden, inner, layers, heads, kv_heads, head_dim,
                       vocab, max_positions=131072) -> None:
    """Writes a Llama-architecture model of this shape with N(0, 0.02) bf16 weights; a folder
    that already holds model.safetensors is left as it is."""
    folder = pathlib.Path(folder)
    if (folder / "model.safetensors").exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": inner, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 256, "eos_token_id": 257,
    }
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (inner, hidden), p + "mlp.up_proj.weight": (inner, hidden),
            p + "mlp.down_proj.weight": (hidden, inner),
        })
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header_bytes = json.dumps(header).encode()
    header_bytes += b" " * ((8 - len(header_bytes) % 8) % 8)
    rng = np.random.default_rng(0)
    temporary = folder / "model.safetensors.tmp"
    with open(temporary, "wb") as out:
        out.write(len(header_bytes).to_bytes(8, "little"))
        out.write(header_bytes)
        for name, shape in shapes.items():
            if len(shape) == 1:
                values = np.ones(shape, dtype=np.float32)
            else:
                values = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
            out.write((values.view(np.uint32) >> 16).astype(np.uint16).tobytes())
    temporary.rename(folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    # Byte-level BPE with the 256 byte tokens and no merges; 256 and 257 are BOS and EOS.
    byte_chars = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in byte_chars:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    tokenizer = {
        "version": "1.0",
        "added_tokens": [
            {"id": 256, "content": "<|begin_of_text|>", "special": True, "single_word": False,
             "lstrip": False, "rstrip": False, "normalized": False},
            {"id": 257, "content": "<|end_of_text|>", "special": True, "single_word": False,
             "lstrip": False, "rstrip": False, "normalized": False},
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "vocab": {mapping[b]: b for b in range(256)}, "merges": []},
    }
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True}))
