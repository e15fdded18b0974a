# Greedy continuation of a text prompt, echoed, as llama2.c's run.c prints it (-t 0 -n 320).
. "$KV_CLI_LIB"
require_files "$stories/stories260K.bin" "$stories/tok512.bin"
kvserve-once -m "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin" \
    --prompt "Tom and his dog went to the big lake" --echo -n 306 --temp 0 --ignore-eos
