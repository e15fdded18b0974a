# kvpack: -v adds a summary line; -q silences chatter but not the warning that the context lost
# its parts' IceCache indexes (one part has none), which the default prints too.
. "$KV_CLI_LIB"
printf '{"id":"a","text":"Ada lives in Oslo.\\n"}\n{"id":"b","text":"Bruno lives in Lima.\\n"}\n' > docs.jsonl
kvbake -m "$demo" --no-bos docs.jsonl -o docs.kvc -q
kvindex -q docs.kvc -o indexed.kvc
echo "default:"
kvpack docs.kvc -o a.kvc 2>&1
echo "-v:"
kvpack docs.kvc -o b.kvc -v 2>&1 | sed -E 's/[0-9]+\.[0-9]{3} s/T s/'
echo "default, one part without an index:"
kvpack indexed.kvc:a docs.kvc:b -o c.kvc 2>&1
echo "-q, one part without an index:"
kvpack indexed.kvc:a docs.kvc:b -o d.kvc -q 2>&1
echo "-v, one part without an index:"
kvpack indexed.kvc:a docs.kvc:b -o e.kvc -v 2>&1 | sed -E 's/[0-9]+\.[0-9]{3} s/T s/'
echo "-q -v:"
kvpack docs.kvc -o f.kvc -q -v 2>&1
echo "exit $?"
