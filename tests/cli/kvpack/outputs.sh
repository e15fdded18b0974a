# kvpack's output: the input itself is refused before any work (the store untouched), a symbolic
# link is written through, /dev/null is written in place.
. "$KV_CLI_LIB"
echo "Ada lives in Oslo." > doc.txt
kvbake -m "$demo" --no-bos -q doc.txt -o e.kvc
cp e.kvc e.copy
kvpack e.kvc -o e.kvc 2>&1
echo "exit $?"
kvpack e.kvc:doc.txt -o e.kvc 2>&1
echo "exit $?"
cmp -s e.kvc e.copy && echo "e.kvc untouched"
ln -s packed.kvc link.kvc
kvpack -q e.kvc -o link.kvc
echo "link: exit $?, $([ -L link.kvc ] && echo 'still a link'), $(kvinspect check packed.kvc >/dev/null && echo 'packed.kvc checks')"
kvpack -q e.kvc -o /dev/null
echo "/dev/null: exit $?, $([ -c /dev/null ] && echo 'still a character device')"
