# --stats - writes the timings as JSON to stderr (stdout carries the text).
. "$KV_CLI_LIB"
require_files "$stories/stories260K.bin" "$stories/tok512.bin"
kvserve-once -m "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin" --prompt "Once" -n 8 --temp 0 \
    --stats - 2>stats.json >/dev/null
/usr/bin/python3 -c '
import json, sys
stats = json.load(open("stats.json"))
for key in ("prefill_tokens_per_second", "time_to_first_token_seconds", "time_per_output_token_seconds"):
    assert stats[key] > 0, key
assert stats["generated_tokens"] == 8 and stats["prompt_tokens"] == 2, stats
print("ok")'
