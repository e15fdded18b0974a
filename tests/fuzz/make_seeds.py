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
