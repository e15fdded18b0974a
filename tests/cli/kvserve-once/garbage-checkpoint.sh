. "$KV_CLI_LIB"
require_files "$stories/tok512.bin"
head -c 4096 /dev/zero | tr "\\0" x > garbage.bin
kvserve-once -m garbage.bin --tokenizer "$stories/tok512.bin" --prompt hi
