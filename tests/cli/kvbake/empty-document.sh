. "$KV_CLI_LIB"
require_files "$stories/stories260K.bin" "$stories/tok512.bin"
printf '{"id": "a", "text": "Lily ran."}\n{"id": "b", "text": ""}\n' > docs.jsonl
kvbake -m "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin" docs.jsonl -o out.kvc
status=$?
[ ! -e out.kvc ] || echo "out.kvc exists"
exit $status
