# A document over the context is refused, or cut to it with --truncate.
. "$KV_CLI_LIB"
require_files "$stories/stories260K.bin" "$stories/tok512.bin"
for i in $(seq 300); do printf 'the cat '; done > long.txt
kvbake -m "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin" --truncate --json long.txt \
    -o out.kvc | /usr/bin/python3 -c 'import json, sys; r = json.load(sys.stdin); print(r["documents"], r["tokens"], r["truncated"])'
kvinspect show out.kvc | grep '^long.txt'
