. "$KV_CLI_LIB"
require_files "$stories/stories260K.bin" "$stories/tok512.bin"
kvbake -m "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin" nope.txt -o out.kvc
