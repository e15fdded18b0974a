# kvserve-once -v: a line at the end of each stage before the first token (packets read, a
# document's layers, a prompt fed token by token) and a summary; by default and with -q, nothing
# on stderr; -q with -v is a usage error. (The times in the summary are masked.)
. "$KV_CLI_LIB"
printf 'Ada lives in Oslo. Ada has a red boat.\n' > doc.txt
kvbake -m "$demo" --no-bos doc.txt -o doc.kvc -q
mask() { sed -E 's/[0-9]+\.[0-9]+ (s|tokens)/T \1/g'; }
serve() { kvserve-once -m "$demo" --temp 0 -n 4 --ignore-eos "$@" 2>&1 >/dev/null | mask; }
echo "default:"; serve --cache doc.kvc --prompt " Ada"
echo "-q:"; serve --cache doc.kvc --prompt " Ada" -q
echo "-v, packets:"; serve --cache doc.kvc --prompt " Ada" -v
echo "-v, a document:"; serve --document doc.txt --prompt " Ada" -v
echo "-v, the prompt through the sparse attention:"
serve --document doc.txt --prompt " Ada lives" --attention icecache --budget 64 --sparse-prompt -v
echo "-q -v:"; kvserve-once -m "$demo" --prompt hi -q -v 2>&1; echo "exit $?"
