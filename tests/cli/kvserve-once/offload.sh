# kvserve-once --offload disk: the packets' keys and values stay in a temporary file and each
# step brings in only the pages it reads; decoding is exactly the same as from memory (with the
# prompt through the sparse attention, as the disk tier always does): the same answer and the same
# choices, for a packed context whose index segments were realigned by kvpack, for packets
# realigned at serve time, with dense layers (streamed from the file in the memory path's
# arithmetic), with every method and with full attention. Standard input and a context without
# --cache files are refused.
. "$KV_CLI_LIB"
kvtasks niah --tokens 1200 --documents 3 --count 1 --seed 4 -o task.jsonl \
    --tokenizer "$demo/tokenizer.json"
kvtasks bake-input task.jsonl -o docs.jsonl
q=$(/usr/bin/python3 -c 'import json; print(json.load(open("task.jsonl"))["question"])')
kvbake -m "$demo" --no-bos docs.jsonl -o docs.kvc -q
kvindex docs.kvc -o docs.kvc -q
kvpack docs.kvc -o context.kvc -q
serve() { kvserve-once -m "$demo" --prompt "$q" -n 10 --temp 0 --ignore-eos "$@"; }
compare() {  # what, then the arguments both runs share
    what=$1
    shift
    serve "$@" --stats host.json > host.txt
    serve "$@" --offload disk --offload-dir . --stats disk.json > disk.txt
    cmp -s host.txt disk.txt && echo "$what: same answer"
    /usr/bin/python3 - "$what" <<'PY'
import json, sys
host, disk = (json.load(open(f)) for f in ("host.json", "disk.json"))
keys = ("index_dot_products", "attended_tokens", "indexed_tokens", "cache_tokens", "attention_recall")
print(f"{sys.argv[1]}: same choices: {all(host.get(k) == disk.get(k) for k in keys)}",
      f"| offload {host['offload']} / {disk['offload']}",
      f"| file holds the cache: {disk['offloaded_bytes'] >= disk['cache_bytes_read']}")
PY
}
sparse="--sparse-prompt --dense-layers 0"
compare "packed, icecache" --cache context.kvc --attention icecache --budget 64 $sparse
compare "realigned at serve time, icecache 128" --cache docs.kvc --attention icecache \
    --budget 128 $sparse
compare "realigned at serve time, icecache 128, a dense layer" --cache docs.kvc \
    --attention icecache --budget 128 --dense-layers 1 --sparse-prompt
compare "packed, quest" --cache context.kvc --attention quest --budget 64 $sparse
compare "packed, quest, 2 dense layers" --cache context.kvc --attention quest --budget 64 \
    --sparse-prompt
compare "packed, h2o, recall measured" --cache context.kvc --attention h2o --budget 64 $sparse \
    --measure-recall
compare "packed, topk, recall measured" --cache context.kvc --attention topk --budget 64 $sparse \
    --measure-recall
compare "packed, full" --cache context.kvc
echo "no temporary file left: $(ls -A | grep -c kvtools-offload)"
serve --cache - --offload disk < context.kvc 2>&1; echo "exit $?"
serve --offload disk 2>&1; echo "exit $?"
serve --cache context.kvc --offload disk --offload-dir no-such-dir 2>&1 | head -2; echo "exit ${PIPESTATUS[0]}"
