# Compressed packets go through the whole pipeline (compress | kvindex | kvpack | kvserve-once),
# compressing while baking equals compressing the baked file, and a compressed packet decodes
# like its uncompressed self when nothing was pruned (--ratio 0).
. "$KV_CLI_LIB"
for i in 1 2 3; do
    echo "{\"id\": \"d$i\", \"text\": \"Document $i says the code of Ada is 4861$i. Bob lives in Paris and keeps a red cat.\"}"
done > docs.jsonl
kvbake -m "$demo" -q docs.jsonl -o docs.kvc || exit 1
kvinspect compress --method knorm --ratio 0.3 docs.kvc -o - | kvindex -q - -o - | kvpack -q - -o - |
    kvserve-once -m "$demo" --cache - --attention icecache --budget 64 --prompt " The code of Ada is" -n 6 \
        --temp 0 >/dev/null && echo "pipeline ok"
kvbake -m "$demo" -q docs.jsonl --compress snapkv --ratio 0.5 -o baked.kvc
kvinspect compress --method snapkv --ratio 0.5 -m "$demo" docs.kvc -o after.kvc
kvinspect diff -q baked.kvc after.kvc && echo "kvbake --compress = kvinspect compress"
kvbake -m "$demo" -q docs.jsonl --compress expected --keep-tokens 20 --json -o k.kvc | grep -o '"stored_tokens": [0-9]*'
kvinspect compress --method knorm --ratio 0 docs.kvc -o same.kvc
kvinspect diff -q docs.kvc same.kvc && echo "ratio 0 changes nothing"
# Only the named packet is compressed; the others are copied.
kvinspect compress --method random --seed 3 --keep-tokens 5 --packet d2 docs.kvc -o one.kvc --json |
    grep -oE '"(compressed|copied|tokens_after)": [0-9]+'
kvinspect show one.kvc | awk '$1 ~ /^d[0-9]$/ {print $1, $2, $3}'
# A per-head context decodes greedily, the same twice.
kvpack -q after.kvc -o ctx.kvc
for run in 1 2; do kvserve-once -m "$demo" --cache ctx.kvc --prompt " The code of Ada is" -n 8 --temp 0; done | uniq | wc -l
