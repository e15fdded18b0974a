# --json reports the packed context: its parts in order, each with the offset it starts at;
# the packed file holds one packet with the realigned positions.
. "$KV_CLI_LIB"
printf '{"id":"a","text":"one two three\\n"}\n{"id":"b","text":"four five\\n"}\n' > docs.jsonl
kvbake -m "$demo" --no-bos docs.jsonl -o docs.kvc -q
kvpack docs.kvc:b docs.kvc:a -o packed.kvc --id both --json | grep -v '"seconds"'
kvinspect packed.kvc --json | grep -E '"id"|_length"'
