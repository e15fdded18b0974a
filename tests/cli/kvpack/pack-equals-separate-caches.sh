# A context packed by kvpack decodes exactly as the same packets given one by one to
# kvserve-once, which realigns them in memory: both rotate keys the same way.
. "$KV_CLI_LIB"
printf '{"id":"a","text":"The pass key is 41234. Remember it.\\n"}\n{"id":"b","text":"The sky is blue and the grass is green.\\n"}\n' > docs.jsonl
kvbake -m "$demo" --no-bos docs.jsonl -o docs.kvc -q
kvpack docs.kvc:a docs.kvc:b -o ab.kvc -q
q="Question: What is the pass key? Answer: The pass key is"
kvserve-once -m "$demo" --cache docs.kvc:a --cache docs.kvc:b --prompt "$q" -n 12 --temp 0 > separate.txt
kvserve-once -m "$demo" --cache ab.kvc --prompt "$q" -n 12 --temp 0 > packed.txt
cmp separate.txt packed.txt && echo same
# A whole file packs all its packets in file order: the same context.
kvpack docs.kvc -o all.kvc -q
kvserve-once -m "$demo" --cache all.kvc --prompt "$q" -n 12 --temp 0 > all.txt
cmp packed.txt all.txt && echo same
