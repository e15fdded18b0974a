# kvindex says nothing on stderr by default (but on a terminal); -v prints one progress line per
# packet and a summary; -q and -v together are a usage error.
. "$KV_CLI_LIB"
printf '{"id":"a","text":"Ada lives in Oslo.\\n"}\n{"id":"b","text":"Bruno lives in Lima.\\n"}\n' > docs.jsonl
kvbake -m "$demo" --no-bos docs.jsonl -o docs.kvc -q
echo "default:"
kvindex docs.kvc -o a.kvc 2>&1
echo "-v:"
kvindex docs.kvc -o b.kvc -v 2>&1 |
    sed -E 's/[0-9]+\.[0-9]{3} s/T s/g; s/[0-9]+ indexes, [0-9]+ pages, up to [0-9]+ levels/I indexes, P pages, up to L levels/'
echo "-q -v:"
kvindex docs.kvc -o c.kvc -q -v 2>&1
echo "exit $?"
