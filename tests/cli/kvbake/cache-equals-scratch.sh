# Decoding from a baked cache equals decoding from scratch, token for token (f32, greedy). The
# prompt is tokenized on its own, as if joined to the document by a space (the dummy prefix).
. "$KV_CLI_LIB"
require_files "$stories/stories260K.bin" "$stories/tok512.bin"
m=(-m "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin")
printf 'Tom and his dog went to the big lake. The sun was hot.' > doc.txt
kvbake "${m[@]}" doc.txt -o doc.kvc -q
kvserve-once "${m[@]}" --cache doc.kvc --prompt "They saw a" -n 120 --temp 0 --ignore-eos > cached.txt
kvserve-once "${m[@]}" --prompt "Tom and his dog went to the big lake. The sun was hot. They saw a" \
    -n 120 --temp 0 --ignore-eos > scratch.txt
cmp cached.txt scratch.txt && wc -w < cached.txt
