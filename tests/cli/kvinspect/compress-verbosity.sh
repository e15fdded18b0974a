# compress prints a report line by default; -v adds one line per compressed packet; -q silences
# the report but not the warning that IceCache indexes were dropped; -q and -v exclude each other.
. "$KV_CLI_LIB"
printf '{"id":"a","text":"Ada lives in Oslo.\\n"}\n{"id":"b","text":"Bruno lives in Lima.\\n"}\n' > docs.jsonl
kvbake -m "$demo" --no-bos docs.jsonl -o docs.kvc -q
kvindex -q docs.kvc -o indexed.kvc
echo "default:"
kvinspect compress --method knorm --ratio 0.5 docs.kvc -o a.kvc 2>&1
echo "-q:"
kvinspect compress --method knorm --ratio 0.5 docs.kvc -o b.kvc -q 2>&1
echo "-v, only packet b:"
kvinspect compress --method streaming --keep-tokens 6 --packet b docs.kvc -o c.kvc -v 2>&1
echo "default, indexed:"
kvinspect compress --method knorm --ratio 0.5 indexed.kvc -o d.kvc 2>&1
echo "-q, indexed:"
kvinspect compress --method knorm --ratio 0.5 indexed.kvc -o e.kvc -q 2>&1
echo "-q --json, indexed:"
kvinspect compress --method knorm --ratio 0.5 indexed.kvc -o f.kvc -q --json 2>&1 | grep -c '"index_dropped": true'
echo "-v, indexed:"
kvinspect compress --method knorm --ratio 0.5 indexed.kvc -o g.kvc -v 2>&1
echo "-q -v:"
kvinspect compress --method knorm --ratio 0.5 docs.kvc -o h.kvc -q -v 2>&1
echo "exit $?"
