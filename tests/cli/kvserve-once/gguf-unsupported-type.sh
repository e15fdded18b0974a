# A GGUF file with a tensor of a type kvtools does not read (Q4_K) is refused naming the tensor.
. "$KV_CLI_LIB"
/usr/bin/python3 - <<'PYTHON'
import struct
def text(s):
    return struct.pack("<Q", len(s)) + s.encode()
metadata = [("general.architecture", 8, "llama"), ("llama.embedding_length", 4, 256),
            ("llama.block_count", 4, 1), ("llama.feed_forward_length", 4, 256),
            ("llama.attention.head_count", 4, 2), ("llama.attention.layer_norm_rms_epsilon", 6, 1e-5)]
out = b"GGUF" + struct.pack("<IQQ", 3, 1, len(metadata))
for key, kind, value in metadata:
    out += text(key) + struct.pack("<I", kind)
    out += text(value) if kind == 8 else struct.pack({4: "<I", 6: "<f"}[kind], value)
out += text("token_embd.weight") + struct.pack("<IQQIQ", 2, 256, 4, 12, 0)
out += bytes(-len(out) % 32) + bytes(4 * 144)
open("q4k.gguf", "wb").write(out)
PYTHON
kvserve-once -m q4k.gguf --prompt hi
