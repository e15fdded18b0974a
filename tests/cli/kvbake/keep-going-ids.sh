# Ids that FILE:ID could not name are refused one document at a time: --keep-going skips an empty
# id and one holding a line break (with the line break escaped, so the message stays one line)
# and bakes the rest; without it the first is the error (exit 1), nothing written. The default
# ids, PATH:LINE, hold ':' and are named as FILE:ID.
. "$KV_CLI_LIB"
{
    echo '{"id": "", "text": "An empty id."}'
    echo '{"id": "two\nlines", "text": "A line feed in the id."}'
    echo '{"text": "Ada lives in Oslo."}'
    echo '{"id": "ok", "text": "Bob lives in Paris."}'
} > docs.jsonl
kvbake -m "$demo" --no-bos --keep-going -q docs.jsonl -o docs.kvc 2>&1
echo "exit $?"
kvpack docs.kvc:docs.jsonl:3 docs.kvc:ok -o two.kvc 2>&1
echo "exit $?"
kvbake -m "$demo" --no-bos -q docs.jsonl -o strict.kvc 2>&1
echo "exit $?"
ls strict.kvc 2>/dev/null || echo "strict.kvc not written"
