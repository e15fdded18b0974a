. "$KV_CLI_LIB"
require_files "$stories/stories260K.bin" "$stories/tok512.bin"
for i in $(seq 300); do printf 'the cat '; done > long.txt
kvserve-once -m "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin" --prompt-file long.txt -n 4
