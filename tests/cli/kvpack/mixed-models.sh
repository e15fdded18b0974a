# Packets baked by different models cannot share a context: one line naming both, exit 1,
# and no output file left behind.
. "$KV_CLI_LIB"
mkdir other
cp "$demo"/* other/
# One byte of the weights changed (the start of the first tensor, which the fingerprint reads)
# is another model.
printf '\x11' | dd of=other/model.safetensors bs=1 seek=20000 conv=notrunc status=none
printf 'Ada lives in Oslo.\n' > doc.txt
kvbake -m "$demo" --no-bos doc.txt -o a.kvc -q
kvbake -m other --no-bos doc.txt -o b.kvc -q
kvpack a.kvc b.kvc -o ab.kvc
echo "exit $?"
test -e ab.kvc && echo "ab.kvc exists"
exit 0
