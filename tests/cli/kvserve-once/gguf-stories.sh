# stories260K converted to GGUF (q and k kept in the interleaved order llama.cpp keeps them,
# tok512.bin as a "llama" tokenizer) decodes as the llama2.c checkpoint does, and as llama.cpp
# does with the same file: BOS alone, then a prompt tokenized from the GGUF metadata.
. "$KV_CLI_LIB"
require_files "$stories/stories260K.bin" "$stories/tok512.bin"
/usr/bin/python3 -c 'import numpy' 2>/dev/null || { echo "skipped: /usr/bin/python3 lacks numpy" >&2; exit 77; }
"$KV_SOURCE_DIR/tests/tools/to_gguf.py" "$stories/stories260K.bin" stories.gguf \
    --tokenizer "$stories/tok512.bin"
kvserve-once -m stories.gguf --prompt "" -n 32 --temp 0
echo
kvserve-once -m stories.gguf --prompt "Lily and Ben" --echo -n 40 --temp 0
echo
