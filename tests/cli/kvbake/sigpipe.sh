# A reader that stops early (head) makes the writer fail with a one-line error, exit 1.
. "$KV_CLI_LIB"
for i in $(seq 200); do echo "{\"id\": \"d$i\", \"text\": \"Document $i.\"}"; done > docs.jsonl
kvbake -m "$demo" -q docs.jsonl | head -c 10 >/dev/null
echo "kvbake exit ${PIPESTATUS[0]}"
