#!/usr/bin/python3
"""Writes a GGUF file (llama.cpp's model format) from a Hugging Face folder or a llama2.c
checkpoint, as llama.cpp's convert_hf_to_gguf.py would for the architectures kvtools reads: the
tests' own converter, since Debian packages no GGUF writer.

    to_gguf.py MODEL_FOLDER OUT.gguf [--type f32|f16|bf16|q8_0] [--pre gpt-2]
    to_gguf.py CHECKPOINT.bin OUT.gguf --tokenizer tok512.bin

A folder needs config.json, model.safetensors and a byte-level tokenizer.json (written as a
"gpt2" tokenizer with the pre-tokenizer named by --pre). A llama2.c checkpoint (legacy header)
is written in F32 with its tok*.bin as a "llama" (sentencepiece) tokenizer; its q and k are
already in the interleaved order GGUF keeps for llama, so they are written as they are, where a
folder's are permuted (convert_hf_to_gguf.py's LlamaModel.permute). Vectors (norms, biases) stay
F32 whatever --type says, as in llama.cpp's converter.
"""
import argparse
import json
import pathlib
import struct

import numpy as np

F32, F16, Q8_0, BF16 = 0, 1, 8, 30
TYPES = {"f32": F32, "f16": F16, "bf16": BF16, "q8_0": Q8_0}
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


class Writer:
    def __init__(self):
        self.metadata = []
        self.tensors = []

    def add(self, key, kind, value):
        self.metadata.append((key, kind, value))

    def tensor(self, name, array, kind):
        """array: float32 numpy array in torch order, or raw uint16 bf16 bits (kind BF16)."""
        if kind == F32:
            data = np.ascontiguousarray(array, dtype="<f4").tobytes()
        elif kind == F16:
            data = np.ascontiguousarray(array, dtype="<f2").tobytes()
        elif kind == BF16:
            data = np.ascontiguousarray(array, dtype="<u2").tobytes()
        else:
            data = quantize_q8_0(array)
        self.tensors.append((name, list(array.shape), kind, data))

    @staticmethod
    def value(kind, item):
        if kind == 8:
            encoded = item.encode() if isinstance(item, str) else item
            return struct.pack("<Q", len(encoded)) + encoded
        if kind == 9:
            element, items = item
            if element == 6:
                return struct.pack("<IQ", 6, len(items)) + np.asarray(items, "<f4").tobytes()
            if element == 5:
                return struct.pack("<IQ", 5, len(items)) + np.asarray(items, "<i4").tobytes()
            return struct.pack("<IQ", element, len(items)) + b"".join(
                Writer.value(element, i) for i in items)
        return struct.pack({4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q"}[kind], item)

    def write(self, path):
        out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(self.tensors), len(self.metadata)))
        for key, kind, item in self.metadata:
            out += self.value(8, key) + struct.pack("<I", kind) + self.value(kind, item)
        offset = 0
        for name, shape, kind, data in self.tensors:
            out += self.value(8, name) + struct.pack("<I", len(shape))
            out += b"".join(struct.pack("<Q", extent) for extent in reversed(shape))
            out += struct.pack("<IQ", kind, offset)
            offset += len(data) + (-len(data) % 32)
        out += bytes(-len(out) % 32)
        for _, _, _, data in self.tensors:
            out += data + bytes(-len(data) % 32)
        pathlib.Path(path).write_bytes(bytes(out))


def quantize_q8_0(array):
    """ggml's quantize_row_q8_0_ref: per block of 32, d = max|x| / 127, q = roundf(x / d) (halves
    away from zero, as C's roundf; numpy's round would take them to even)."""
    blocks = np.asarray(array, np.float32).reshape(-1, 32)
    d = np.abs(blocks).max(axis=1) / np.float32(127)
    inverse = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    scaled = blocks * inverse[:, None]
    q = (np.sign(scaled) * np.floor(np.abs(scaled) + np.float32(0.5))).astype(np.int8)  # roundf
    out = np.zeros(len(blocks), dtype=[("d", "<f2"), ("q", "i1", 32)])
    out["d"] = d.astype(np.float16)
    out["q"] = q
    return out.tobytes()


def permute(weights, heads):
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def read_safetensors(path):
    raw = pathlib.Path(path).read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + length])
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        data = raw[8 + length + begin:8 + length + end]
        dtype = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}[entry["dtype"]]
        tensors[name] = (entry["dtype"], np.frombuffer(data, dtype).reshape(entry["shape"]))
    return tensors


def as_float32(dtype, array):
    if dtype == "BF16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def hyperparameters(writer, architecture, c):
    p = architecture + "."
    head_dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    writer.add("general.architecture", 8, architecture)
    writer.add(p + "context_length", 4, c.get("max_position_embeddings", 2048))
    writer.add(p + "embedding_length", 4, c["hidden_size"])
    writer.add(p + "block_count", 4, c["num_hidden_layers"])
    writer.add(p + "feed_forward_length", 4, c["intermediate_size"])
    writer.add(p + "attention.head_count", 4, c["num_attention_heads"])
    writer.add(p + "attention.head_count_kv", 4, c.get("num_key_value_heads", c["num_attention_heads"]))
    writer.add(p + "attention.key_length", 4, head_dim)
    writer.add(p + "attention.value_length", 4, head_dim)
    writer.add(p + "rope.dimension_count", 4, head_dim)
    writer.add(p + "rope.freq_base", 6, c.get("rope_theta", 10000.0))
    writer.add(p + "attention.layer_norm_rms_epsilon", 6, c.get("rms_norm_eps", 1e-6))


def from_folder(folder, writer, kind, pre):
    c = json.loads((folder / "config.json").read_text())
    architecture = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
                    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[c["architectures"][0]]
    hyperparameters(writer, architecture, c)
    tensors = read_safetensors(folder / "model.safetensors")
    for name, (dtype, array) in tensors.items():
        if name in GLOBAL_NAMES:
            gguf = GLOBAL_NAMES[name]
        else:
            parts = name.split(".")  # model.layers.N.rest
            gguf = "blk." + parts[2] + "." + LAYER_NAMES[".".join(parts[3:])]
        heads = None
        if architecture == "llama" and "q_proj" in name:
            heads = c["num_attention_heads"]
        elif architecture == "llama" and "k_proj" in name:
            heads = c.get("num_key_value_heads", c["num_attention_heads"])
        tensor_kind = F32 if array.ndim == 1 else kind
        if tensor_kind == BF16 and dtype == "BF16":
            values = array  # the bits as they are
        elif tensor_kind == BF16:
            raise SystemExit("bf16 output needs bf16 weights")
        else:
            values = as_float32(dtype, array)
        writer.tensor(gguf, permute(values, heads) if heads else values, tensor_kind)

    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokens, types = {}, {}
    for token, i in tokenizer["model"]["vocab"].items():
        tokens[i], types[i] = token, NORMAL
    for added in tokenizer["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = CONTROL if added["special"] else USER_DEFINED
    # Padded to the embedding's rows as convert_hf_to_gguf.py pads ([PADn], unused): llama.cpp
    # refuses a vocabulary shorter than token_embd.
    count = max(max(tokens) + 1, c.get("vocab_size", 0))
    writer.add("tokenizer.ggml.model", 8, "gpt2")
    writer.add("tokenizer.ggml.pre", 8, pre)
    writer.add("tokenizer.ggml.tokens", 9, (8, [tokens.get(i, f"[PAD{i}]") for i in range(count)]))
    writer.add("tokenizer.ggml.token_type", 9, (5, [types.get(i, UNUSED) for i in range(count)]))
    writer.add("tokenizer.ggml.merges", 9, (8, [m if isinstance(m, str) else " ".join(m)
                                                for m in tokenizer["model"]["merges"]]))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    for key, field in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        if isinstance(c.get(field), int):
            writer.add("tokenizer.ggml." + key, 4, c[field])
    for key in ("add_bos_token", "add_eos_token"):
        if isinstance(config.get(key), bool):
            writer.add("tokenizer.ggml." + key, 7, config[key])
    if isinstance(config.get("chat_template"), str):
        writer.add("tokenizer.chat_template", 8, config["chat_template"])


def from_llama2c(checkpoint, tokenizer_path, writer):
    raw = pathlib.Path(checkpoint).read_bytes()
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = struct.unpack("<7i", raw[:28])
    shared = vocab > 0
    vocab = abs(vocab)
    head_dim = dim // heads
    hyperparameters(writer, "llama", {
        "max_position_embeddings": seq_len, "hidden_size": dim, "num_hidden_layers": layers,
        "intermediate_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5})
    values = np.frombuffer(raw, "<f4", offset=28)
    at = 0

    def take(*shape):
        nonlocal at
        count = int(np.prod(shape))
        block = values[at:at + count].reshape(shape)
        at += count
        return block

    embedding = take(vocab, dim)
    blocks = {}
    for name, shape in (("attn_norm", (dim,)), ("attn_q", (dim, dim)),
                        ("attn_k", (kv_heads * head_dim, dim)), ("attn_v", (kv_heads * head_dim, dim)),
                        ("attn_output", (dim, dim)), ("ffn_norm", (dim,)), ("ffn_gate", (hidden, dim)),
                        ("ffn_down", (dim, hidden)), ("ffn_up", (hidden, dim))):
        blocks[name] = take(layers, *shape)
    final_norm = take(dim)
    take(seq_len * head_dim // 2)
    take(seq_len * head_dim // 2)
    writer.tensor("token_embd.weight", embedding, F32)
    writer.tensor("output_norm.weight", final_norm, F32)
    if not shared:
        writer.tensor("output.weight", take(vocab, dim), F32)
    for layer in range(layers):
        for name, block in blocks.items():
            writer.tensor(f"blk.{layer}.{name}.weight", block[layer], F32)

    data = pathlib.Path(tokenizer_path).read_bytes()
    at, pieces, scores, types = 4, [], [], []
    while at < len(data):
        score, length = struct.unpack("<fi", data[at:at + 8])
        piece = data[at + 8:at + 8 + length]
        at += 8 + length
        pieces.append(piece)
        scores.append(score)
    for i, piece in enumerate(pieces):
        if i == 0:
            pieces[i], kind = b"<unk>", UNKNOWN
        elif i in (1, 2):
            pieces[i], kind = (b"<s>", b"</s>")[i - 1], CONTROL
        elif piece.startswith(b"<0x") and len(piece) == 6:
            kind = BYTE
        else:
            pieces[i], kind = piece.replace(b" ", "\u2581".encode()), NORMAL
        types.append(kind)
    writer.add("tokenizer.ggml.model", 8, "llama")
    writer.add("tokenizer.ggml.tokens", 9, (8, pieces))
    writer.add("tokenizer.ggml.scores", 9, (6, scores))
    writer.add("tokenizer.ggml.token_type", 9, (5, types))
    writer.add("tokenizer.ggml.bos_token_id", 4, 1)
    writer.add("tokenizer.ggml.eos_token_id", 4, 2)
    writer.add("tokenizer.ggml.unknown_token_id", 4, 0)
    writer.add("tokenizer.ggml.add_bos_token", 7, True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=pathlib.Path)
    parser.add_argument("output", type=pathlib.Path)
    parser.add_argument("--type", choices=sorted(TYPES), default="f32")
    parser.add_argument("--pre", default="gpt-2", help="tokenizer.ggml.pre of a folder's tokenizer")
    parser.add_argument("--tokenizer", type=pathlib.Path, help="a llama2.c checkpoint's tok*.bin")
    args = parser.parse_args()
    writer = Writer()
    if args.model.is_dir():
        from_folder(args.model, writer, TYPES[args.type], args.pre)
    else:
        if not args.tokenizer:
            parser.error("a llama2.c checkpoint needs --tokenizer")
        from_llama2c(args.model, args.tokenizer, writer)
    writer.write(args.output)


if __name__ == "__main__":
    main()
