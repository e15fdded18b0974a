# Greedy decoding from BOS alone prints exactly what llama2.c's run.c prints (-t 0 -n 300).
. "$KV_CLI_LIB"
require_files "$stories/stories260K.bin" "$stories/tok512.bin"
kvserve-once -m "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin" --prompt "" -n 300 --temp 0 --ignore-eos
