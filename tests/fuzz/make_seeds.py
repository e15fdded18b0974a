#!/usr/bin/env python3
"""Writes the small hand-made seed inputs under seeds/ (the larger seeds are the test data and
the demo model's files, which tests/fuzz/CMakeLists.txt and scripts/fuzz name directly)."""
import json
import pathlib
import struct

root = pathlib.Path(__file__).resolve().parent / "seeds"


def write(target, name, data):
    folder = root / target
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data if isinstance(data, bytes) else data.encode())


def safetensors(tensors, metadata=None):
    header, blobs, offset = {}, [], 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


write("safetensors", "two_tensors.safetensors", safetensors({
    "model.embed_tokens.weight": ("F32", [2, 3], struct.pack("<6f", *range(6))),
    "model.norm.weight": ("BF16", [4], bytes(8)),
}, {"format": "pt"}))
write("safetensors", "empty_tensor.safetensors", safetensors({"x": ("I64", [0, 4], b"")}))
write("safetensors", "u8_i32_f16.safetensors", safetensors({
    "a": ("U8", [3], b"abc"), "b": ("I32", [1], struct.pack("<i", -7)), "c": ("F16", [2], bytes(4)),
}))

llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
         "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 2048,
         "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
         "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": [2, 3]}
write("model_config", "llama.json", json.dumps(llama, indent=1))
write("model_config", "llama3_scaling.json", json.dumps(dict(llama, rope_scaling={
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}, head_dim=16)))

vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
for byte in range(256):
    vocab[f"<0x{byte:02X}>"] = len(vocab)
merges = []
for left, right in [("▁", "t"), ("h", "e"), ("▁t", "he"), ("c", "o"), ("d", "e"), ("co", "de")]:
    for piece in (left, right, left + right):
        vocab.setdefault(piece, len(vocab))
    merges.append(f"{left} {right}")
write("tokenizer_json", "sentencepiece_bpe.json", json.dumps({
    "version": "1.0",
    "added_tokens": [{"id": 0, "content": "<unk>", "special": True},
                     {"id": 1, "content": "<s>", "special": True},
                     {"id": 2, "content": "</s>", "special": True}],
    "normalizer": {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "},
                                               "content": "▁"}]},
    "pre_tokenizer": None,
    "decoder": {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1,
                                                     "stop": 0}]},
    "model": {"type": "BPE", "unk_token": "<unk>", "byte_fallback": True, "fuse_unk": True,
              "vocab": vocab, "merges": merges}}))

write("documents_jsonl", "mixed.jsonl",
      '{"id": "a", "text": "The code of Ada is 48613."}\n'
      '\n{"id": 7, "text": "caf\\u00e9 \\ud83d\\ude00 tab\\tnew\\nline"}\r\n'
      '{"text": "no id"}\n{"id": null, "text": ""}\n')
write("documents_jsonl", "duplicate.jsonl", '{"id": "x", "text": "1"}\n{"id": "x", "text": "2"}\n')
write("documents_jsonl", "malformed.jsonl", '{"id": "x", "text": "1"}\n{"id": "y", "text": \n')


def gguf(metadata, tensors=(), version=3):
    """A GGUF file: metadata as (key, type, value) with GGUF's type numbers, tensors as
    (name, torch-order shape, ggml type, bytes), each at the next multiple of 32."""
    def value(kind, item):
        if kind == 8:
            encoded = item.encode()
            return struct.pack("<Q", len(encoded)) + encoded
        if kind == 9:
            element, items = item
            return struct.pack("<IQ", element, len(items)) + b"".join(value(element, i) for i in items)
        return struct.pack({4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q"}[kind], item)
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(metadata))
    for key, kind, item in metadata:
        out += value(8, key) + struct.pack("<I", kind) + value(kind, item)
    offset, blobs = 0, b""
    for name, shape, kind, data in tensors:
        out += value(8, name) + struct.pack("<I", len(shape))
        out += b"".join(struct.pack("<Q", extent) for extent in reversed(shape))
        out += struct.pack("<IQ", kind, offset)
        blobs += data + bytes(-len(data) % 32)
        offset += len(data) + (-len(data) % 32)
    return out + bytes(-len(out) % 32) + blobs


def llama_metadata(architecture, tokenizer):
    p = architecture + "."
    return [("general.architecture", 8, architecture), (p + "context_length", 4, 64),
            (p + "embedding_length", 4, 32), (p + "block_count", 4, 1),
            (p + "feed_forward_length", 4, 32), (p + "attention.head_count", 4, 2),
            (p + "attention.head_count_kv", 4, 1), (p + "attention.layer_norm_rms_epsilon", 6, 1e-5),
            (p + "rope.freq_base", 6, 10000.0), ("tokenizer.ggml.bos_token_id", 4, 1),
            ("tokenizer.ggml.eos_token_id", 4, 2), ("tokenizer.chat_template", 8, "{{ x }}")] + tokenizer


bpe_tokens = ["!", "<s>", "</s>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["he", "hel"]
bpe_tokenizer = [("tokenizer.ggml.model", 8, "gpt2"), ("tokenizer.ggml.pre", 8, "qwen2"),
                 ("tokenizer.ggml.tokens", 9, (8, bpe_tokens)),
                 ("tokenizer.ggml.token_type", 9, (5, [1, 3, 3] + [1] * (len(bpe_tokens) - 3))),
                 ("tokenizer.ggml.merges", 9, (8, ["h e", "he l"]))]
spm_tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁", "h", "e", "▁h", "he"]
spm_tokenizer = [("tokenizer.ggml.model", 8, "llama"), ("tokenizer.ggml.tokens", 9, (8, spm_tokens)),
                 ("tokenizer.ggml.scores", 9, (6, [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0])),
                 ("tokenizer.ggml.token_type", 9, (5, [2, 3, 3] + [6] * 256 + [1] * 5)),
                 ("tokenizer.ggml.add_bos_token", 7, True)]
f32 = lambda count: struct.pack(f"<{count}f", *[(i % 7) / 7 for i in range(count)])
q8_0 = lambda rows: (struct.pack("<e", 0.01) + bytes(range(32))) * rows
write("gguf", "qwen2_bpe.gguf", gguf(llama_metadata("qwen2", bpe_tokenizer), [
    ("token_embd.weight", [len(bpe_tokens), 32], 8, q8_0(len(bpe_tokens))),
    ("output_norm.weight", [32], 0, f32(32)),
    ("blk.0.attn_q.bias", [32], 0, f32(32)),
    ("blk.0.attn_q.weight", [32, 32], 1, bytes(32 * 32 * 2))]))
write("gguf", "llama_spm_v2.gguf", gguf(llama_metadata("llama", spm_tokenizer), [
    ("token_embd.weight", [len(spm_tokens), 32], 30, bytes(len(spm_tokens) * 32 * 2)),
    ("rope_freqs.weight", [8], 0, struct.pack("<8f", *[1.0] * 8))], version=2))
write("gguf", "metadata_only.gguf", gguf([
    ("general.alignment", 4, 64), ("a", 9, (9, [])), ("b", 10, 2 ** 40), ("c", 5, -3),
    ("d", 7, False), ("e", 9, (6, [1.5, -2.0]))]))
