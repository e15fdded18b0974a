. "$KV_CLI_LIB"
require_files "$stories/stories260K.bin" "$stories/tok512.bin"
for i in $(seq 300); do printf 'the cat '; done > long.txt
kvbake -m "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin" long.txt -o out.kvc
