# -v prints one progress line per batch, also when stderr is not a terminal, then the summary;
# by default only the summary; -q nothing; -q and -v together are a usage error.
. "$KV_CLI_LIB"
printf '{"id":"a","text":"Ada lives in Oslo.\\n"}\n{"id":"b","text":"Bruno lives in Lima.\\n"}\n' > docs.jsonl
times() { sed -E 's/[0-9]+ tokens\/s/R tokens\/s/; s/in [0-9]+\.[0-9]{2} s/in T s/'; }
echo "default:"
kvbake -m "$demo" --no-bos docs.jsonl -o a.kvc 2>&1 | times
echo "-v, batches of one document:"
kvbake -m "$demo" --no-bos docs.jsonl -o b.kvc --batch-tokens 8 -v 2>&1 | times
echo "-q:"
kvbake -m "$demo" --no-bos docs.jsonl -o c.kvc -q 2>&1
echo "-q -v:"
kvbake -m "$demo" --no-bos docs.jsonl -o d.kvc -q -v 2>&1
echo "exit $?"
[ -e d.kvc ] || echo "nothing written"
