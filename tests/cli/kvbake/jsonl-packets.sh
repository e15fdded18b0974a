# A JSONL input bakes one packet per line, in order, ids kept; two caches pack in order.
. "$KV_CLI_LIB"
require_files "$stories/stories260K.bin" "$stories/tok512.bin"
m=(-m "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin")
cat > docs.jsonl <<'JSONL'
{"id": "ball", "text": "Lily had a red ball."}
{"id": 7, "text": "Tom saw a big dog."}

{"text": "The sun was hot."}
JSONL
kvbake "${m[@]}" docs.jsonl -o docs.kvc -q
kvinspect show --json docs.kvc | /usr/bin/python3 -c '
import json, sys
info = json.load(sys.stdin)
print(" ".join(p["id"] for p in info["packets"]))'
kvserve-once "${m[@]}" --cache docs.kvc --cache docs.kvc --prompt "Then" -n 5 --temp 0 --stats stats.json > /dev/null
/usr/bin/python3 -c 'import json; s = json.load(open("stats.json")); print(s["cache_tokens"], s["context_tokens"] - s["prompt_tokens"])'
