. "$KV_CLI_LIB"
require_files "$stories/stories260K.bin" "$stories/tok512.bin"
head -c 500000 "$stories/stories260K.bin" > cut.bin
kvserve-once -m cut.bin --tokenizer "$stories/tok512.bin" --prompt hi --temp 0
