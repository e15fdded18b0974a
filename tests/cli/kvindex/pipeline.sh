# bake | index | pack | serve with IceCache's sparse attention in one pipe decodes as the same
# steps through files, and the context is served by the index kvindex stored, not rebuilt.
. "$KV_CLI_LIB"
kvtasks niah --tokens 600 --documents 2 --count 1 --seed 3 -o task.jsonl \
    --tokenizer "$demo/tokenizer.json"
kvtasks bake-input task.jsonl -o docs.jsonl
q=$(/usr/bin/python3 -c 'import json; print(json.load(open("task.jsonl"))["question"])')
kvbake -m "$demo" --no-bos docs.jsonl -o - -q | kvindex - -o - -q | kvpack - -o - -q |
    kvserve-once -m "$demo" --cache - --prompt "$q" -n 8 --temp 0 --attention icecache \
        --budget 64 --stats stats.json > from-pipe.txt
kvbake -m "$demo" --no-bos docs.jsonl -o docs.kvc -q
kvindex docs.kvc -o docs.kvc -q
kvpack docs.kvc -o context.kvc -q
kvserve-once -m "$demo" --cache context.kvc --prompt "$q" -n 8 --temp 0 --attention icecache \
    --budget 64 > from-files.txt
cmp from-files.txt from-pipe.txt && echo same
/usr/bin/python3 - <<'PY'
import json
stats = json.load(open("stats.json"))
# Only rows decoding added (BOS, the prompt, generated tokens) were indexed while serving.
print("attention", stats["attention"], "budget", stats["budget"])
print("stored index used:", stats["indexed_tokens"] < stats["cache_tokens"])
print("recall reported only when measured:", "attention_recall" not in stats)
PY
