# kvbake -o - | kvserve-once --cache - works in a pipe and decodes as from a file.
. "$KV_CLI_LIB"
require_files "$stories/stories260K.bin" "$stories/tok512.bin"
m=(-m "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin")
printf 'Lily had a red ball.' > doc.txt
kvbake "${m[@]}" doc.txt -o doc.kvc -q
kvserve-once "${m[@]}" --cache doc.kvc --prompt "She" -n 40 --temp 0 > from-file.txt
kvbake "${m[@]}" doc.txt -o - -q | kvserve-once "${m[@]}" --cache - --prompt "She" -n 40 --temp 0 > from-pipe.txt
cmp from-file.txt from-pipe.txt && echo same
