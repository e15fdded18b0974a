# kvserve-once --document: a long document prefilled layer by layer answers exactly as the same
# document baked and served from its cache; with IceCache every row between the sink and the
# window is indexed; the document alone, without a prompt, is continued; it can come from stdin; the two
# ways of giving a context exclude each other; an empty document is refused.
. "$KV_CLI_LIB"
kvtasks passkey --tokens 1200 --count 1 --seed 5 -o task.jsonl
/usr/bin/python3 -c "
import json; t = json.loads(open('task.jsonl').readline())
open('document.txt', 'w').write(''.join(t['documents']))
open('question.txt', 'w').write(t['question'])"
serve() { kvserve-once -m "$demo" --temp 0 -n 8 --ignore-eos "$@"; }
serve --document document.txt --prompt-file question.txt > by-layer.txt
kvbake -m "$demo" document.txt -o - -q | serve --cache - --prompt-file question.txt > baked.txt
cmp -s by-layer.txt baked.txt && echo "document = baked cache: same answer"
serve --document document.txt --prompt-file question.txt --attention icecache --budget 64 \
    --stats stats.json > /dev/null
/usr/bin/python3 - <<'PY'
import json
s = json.load(open("stats.json"))
prompt = s["prompt_tokens"]
print("document tokens > 1000:", s["document_tokens"] > 1000, "| cache tokens:", s["cache_tokens"])
# Every row between the 16-token sink and the 16-token window was indexed, in the two sparse
# layers of the demo model's four, for its two kv heads: the document's as each layer was done
# (inline on the host; the worker thread serves accelerators), the prompt's and 7 generated
# tokens' after it.
rows = s["document_tokens"] + prompt + 7
print("indexed rows:", s["indexed_tokens"] == (rows - 16 - 16) * 2 * 2, "| index built:", s["index_seconds"] > 0,
      "| no worker on the host:", s["index_wait_seconds"] == 0)
PY
kvserve-once -m "$demo" --temp 0 -n 4 --ignore-eos --document document.txt > continued.txt &&
    echo "continued: $(wc -w < continued.txt) words"
cat document.txt | serve --document - --prompt-file question.txt > from-stdin.txt
cmp -s by-layer.txt from-stdin.txt && echo "document from stdin: same answer"
kvserve-once -m "$demo" --document document.txt --cache x.kvc --prompt hi 2>&1; echo "exit $?"
: > empty.txt
kvserve-once -m "$demo" --document empty.txt --prompt hi 2>&1; echo "exit $?"
