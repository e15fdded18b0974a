# --keep-going with nothing left to bake is an error, not an empty store.
. "$KV_CLI_LIB"
echo '{"id": "a", "text": ""}' > docs.jsonl
kvbake -m "$demo" --keep-going -q docs.jsonl -o out.kvc
status=$?
[ ! -e out.kvc ] || echo "out.kvc exists"
exit $status
