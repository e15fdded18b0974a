. "$KV_CLI_LIB"
require_files "$stories/tok512.bin"
mkdir model
cat > model/config.json <<'JSON'
{"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 172,
 "num_hidden_layers": 5, "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 512}
JSON
# A header length of 4096 bytes, then only a few bytes of header.
printf '\x00\x10\x00\x00\x00\x00\x00\x00{"a":' > model/model.safetensors
kvserve-once -m model --tokenizer "$stories/tok512.bin" --prompt hi
