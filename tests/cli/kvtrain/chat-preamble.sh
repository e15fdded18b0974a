# kvtrain --chat-preamble: teacher and student read the model's chat template around the sample
# (its start before the documents instead of BOS, the end of the user's turn after the question),
# and the adapter records the rendered preamble, so that --resume refuses another system
# message; a model without a template, and --system alone, are refused.
. "$KV_CLI_LIB"
require_h5py
kvtasks bios --tokens 256 --count 2 --seed 5 -o data.jsonl
# The demo model with a chat template in its tokenizer_config.json (Zephyr's layout).
mkdir chat && for f in config.json model.safetensors tokenizer.json; do ln -s "$demo/$f" chat/$f; done
/usr/bin/python3 -c "
import json, sys
config = json.load(open(sys.argv[1]))
config['chat_template'] = (\"{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\"
    \"{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}\")
json.dump(config, open('chat/tokenizer_config.json', 'w'))" "$demo/tokenizer_config.json"
train() { kvtrain --data data.jsonl --epochs 1 --batch 2 --answer-stop newline --answer-tokens 4 "$@"; }
run() { "$@" 2>&1 | sed -e "s|$demo|DEMO|g" -e "s|$PWD|.|g"; echo "exit ${PIPESTATUS[0]}"; }
train -m chat --chat-preamble --system "Be brief." --max-steps 1 -o adapter.kvc -q && echo "trained"
/usr/bin/python3 - <<'PY'
import h5py, json
with h5py.File("adapter.kvc", "r") as f:
    training = json.loads(f["adapter"].attrs["training"])
print(json.dumps(training["settings"]["chat_preamble"], sort_keys=True))
PY
run train -m chat --chat-preamble --system "Be long." --resume -o adapter.kvc -q
run train -m "$demo" --chat-preamble -o plain.kvc -q
run train -m chat --system "Be brief." -o plain.kvc -q
