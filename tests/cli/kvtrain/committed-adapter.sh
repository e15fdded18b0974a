# The adapter committed beside the demo model is sound, belongs to it, and wraps documents.
. "$KV_CLI_LIB"
adapter=$demo/adapter-mixture.kvc
kvinspect check "$adapter" && echo "check: sound"
kvinspect show "$adapter" | grep -o 'adapter:     8 + 8 soft tokens of width 256, fingerprint [0-9a-f]*, trained 180 of 180 steps' | sed 's/fingerprint [0-9a-f]*/fingerprint F/'
printf '{"id": "d", "text": "Ada Lovelace lives in Lisbon.\\n"}\n' > docs.jsonl
kvbake -m "$demo" --adapter "$adapter" docs.jsonl -o packets.kvc -q
kvinspect show packets.kvc | awk '$1 == "d" { print $2, $3, $5 }'
