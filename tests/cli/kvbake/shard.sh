# --shard I/N bakes every N-th document starting at the I-th (0-based).
. "$KV_CLI_LIB"
require_files "$stories/stories260K.bin" "$stories/tok512.bin"
m=(-m "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin")
for i in 0 1 2 3 4; do echo "{\"id\": \"d$i\", \"text\": \"Lily ran $i times.\"}"; done > docs.jsonl
kvbake "${m[@]}" docs.jsonl --shard 1/2 -o odd.kvc -q
kvinspect show --json odd.kvc | /usr/bin/python3 -c '
import json, sys
print(" ".join(p["id"] for p in json.load(sys.stdin)["packets"]))'
