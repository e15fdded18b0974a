# kvbake -o - | kvinspect show - works in a pipe.
. "$KV_CLI_LIB"
require_files "$stories/stories260K.bin" "$stories/tok512.bin"
printf 'Lily had a red ball.' > doc.txt
kvbake -m "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin" doc.txt -o - -q | kvinspect show - |
    grep -E '^(format|packets):|^doc\.txt'
