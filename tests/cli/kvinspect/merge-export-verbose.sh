# merge and export say nothing on stderr unless -v, which adds a summary line: what was written.
. "$KV_CLI_LIB"
export KV_NO_TIMESTAMP=1
printf '{"id":"a","text":"Ada lives in Oslo.\\n"}\n' > a.jsonl
printf '{"id":"b","text":"Bruno lives in Lima.\\n"}\n{"id":"c","text":"Carla.\\n"}\n' > b.jsonl
kvbake -m "$demo" --no-bos a.jsonl -o a.kvc -q
kvbake -m "$demo" --no-bos b.jsonl -o b.kvc -q
echo "merge:"
kvinspect merge a.kvc b.kvc -o ab.kvc 2>&1
echo "merge -v:"
kvinspect merge -v a.kvc - -o ab.kvc < b.kvc 2>&1
kvinspect merge -v b.kvc -o - 2>&1 >/dev/null
echo "export:"
kvinspect export --to safetensors ab.kvc -o ab.safetensors 2>&1
echo "export -v:"
kvinspect export --to safetensors ab.kvc -o ab.safetensors -v 2>&1
echo "size $(stat -c %s ab.safetensors)"
echo "merge -q:"
kvinspect merge -q a.kvc -o x.kvc 2>&1
echo "exit $?"
