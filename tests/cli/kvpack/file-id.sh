# FILE:ID splits at the last ':' whose left part is an existing file (kvpack(1)): ids holding ':'
# (kvbake's default PATH:LINE ids) are named; a file whose name holds ':' is read whole, and
# where both readings name files the longer file name wins. 'FILE:' is an error (exit 2), and a
# FILE:ID whose FILE is missing names that file (exit 1).
. "$KV_CLI_LIB"
printf '{"text": "Ada lives in Oslo."}\n{"text": "Bob lives in Paris."}\n' > docs.jsonl
kvbake -m "$demo" --no-bos -q docs.jsonl -o docs.kvc
kvpack docs.kvc:docs.jsonl:2 -o two.kvc
echo "exit $?"
kvpack docs.kvc:docs.jsonl:9 -o out.kvc 2>&1
echo "exit $?"
kvpack docs.kvc: -o out.kvc 2>&1
echo "exit $?"
kvpack nowhere.kvc:doc -o out.kvc 2>&1
echo "exit $?"
kvpack nowhere.kvc:docs.jsonl:1 -o out.kvc 2>&1
echo "exit $?"
cp docs.kvc docs.kvc:docs.jsonl
kvpack docs.kvc:docs.jsonl -o all.kvc
echo "exit $?"
kvpack docs.kvc:docs.jsonl:2 -o out.kvc 2>&1
echo "exit $?"
ls out.kvc 2>/dev/null || echo "out.kvc not written"
