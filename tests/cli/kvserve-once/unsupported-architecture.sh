. "$KV_CLI_LIB"
require_files "$stories/tok512.bin"
mkdir model
echo '{"architectures": ["GPT2LMHeadModel"], "vocab_size": 512}' > model/config.json
kvserve-once -m model --tokenizer "$stories/tok512.bin" --prompt hi
