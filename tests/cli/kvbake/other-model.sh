# A cache baked with another model or tokenizer is refused, naming both fingerprints.
. "$KV_CLI_LIB"
require_files "$stories/stories260K.bin" "$stories/tok512.bin"
printf 'Lily had a red ball.' > doc.txt
kvbake -m "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin" doc.txt -o doc.kvc -q
# The same shapes with one weight changed (a byte of the embedding) is another model.
cp "$stories/stories260K.bin" other.bin
printf '\x7f' | dd of=other.bin bs=1 seek=100 conv=notrunc status=none
kvserve-once -m other.bin --tokenizer "$stories/tok512.bin" --cache doc.kvc --prompt "She" -n 4 2>&1
echo "exit $?"
# One score changed in the tokenizer file is another tokenizer.
cp "$stories/tok512.bin" other-tok.bin
printf '\x01' | dd of=other-tok.bin bs=1 seek=6 conv=notrunc status=none
kvserve-once -m "$stories/stories260K.bin" --tokenizer other-tok.bin --cache doc.kvc --prompt "She" -n 4 2>&1
echo "exit $?"
