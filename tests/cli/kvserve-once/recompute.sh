# kvserve-once --recompute: full recompute of packed packets answers exactly as the documents
# prefilled as one prompt; EPIC and CacheBlend recompute the tokens they say (--stats); packets
# with soft tokens cannot be recomputed.
. "$KV_CLI_LIB"
kvtasks niah --tokens 256 --count 1 --documents 3 --seed 4 -o data.jsonl
kvtasks bake-input data.jsonl -o docs.jsonl
kvbake -m "$demo" --no-bos docs.jsonl -o plain.kvc -q --dtype f32
/usr/bin/python3 -c "
import json; t = json.loads(open('data.jsonl').readline())
open('whole.txt', 'w').write(''.join(t['documents']) + t['question'])
open('question.txt', 'w').write(t['question'])"
caches="--cache plain.kvc:niah-256-0/0 --cache plain.kvc:niah-256-0/1 --cache plain.kvc:niah-256-0/2"
serve() { kvserve-once -m "$demo" --dtype f32 --temp 0 -n 12 --ignore-eos "$@"; }
serve --prompt-file whole.txt > full.txt
serve $caches --prompt-file question.txt --recompute all --stats stats-all.json > all.txt
cmp -s full.txt all.txt && echo "recompute all = one prompt: same answer"
field() { /usr/bin/python3 -c "import json; s = json.load(open('$1')); print(s['recompute'], s['recomputed_per_layer'], s['cache_tokens'])"; }
field stats-all.json
serve $caches --prompt-file question.txt --recompute epic --recompute-tokens 5 --stats stats-epic.json > /dev/null
field stats-epic.json
serve $caches --prompt-file question.txt --recompute cacheblend --recompute-ratio 0.25 --stats stats-blend.json > /dev/null
field stats-blend.json
kvserve-once -m "$demo" --prompt-file question.txt --recompute all 2>&1; echo "exit $?"
kvtasks bios --tokens 256 --count 2 --seed 5 -o train.jsonl
kvtrain -m "$demo" --data train.jsonl --epochs 1 --batch 2 --answer-stop newline --answer-tokens 4 -o adapter.kvc -q
kvbake -m "$demo" --adapter adapter.kvc docs.jsonl -o packets.kvc -q
kvserve-once -m "$demo" --cache packets.kvc:niah-256-0/0 --prompt-file question.txt --recompute epic 2>&1; echo "exit $?"
# Tokens pruned per head have no single token per slot to recompute.
kvinspect compress --method knorm --ratio 0.5 plain.kvc -o pruned.kvc 2>/dev/null
kvserve-once -m "$demo" --cache pruned.kvc:niah-256-0/0 --prompt-file question.txt --recompute epic 2>&1; echo "exit $?"
