# A FILE:ID whose FILE does not exist names the file, on the command line and in a request of
# --requests (which fails that request only).
. "$KV_CLI_LIB"
echo "Ada lives in Oslo." > doc.txt
kvbake -m "$demo" --no-bos -q doc.txt -o store.kvc
serve() { kvserve-once -m "$demo" -t 1 -n 2 --temp 0 "$@"; }
serve --cache nowhere.kvc:doc -p "Where?" 2>&1
echo "exit $?"
{
    echo '{"id": "missing", "cache": ["nowhere.kvc:doc"], "prompt": "Where?"}'
    echo '{"id": "no id", "cache": ["store.kvc:"], "prompt": "Where?"}'
    echo '{"id": "good", "cache": ["store.kvc:doc.txt"], "prompt": "Where?"}'
} > requests.jsonl
serve --requests requests.jsonl 2>&1 | sed 's/"text":"[^"]*"/"text":.../; s/,"stats":{.*}//'
echo "exit ${PIPESTATUS[0]}"
