# kvbake --chat-preamble: KV Packet's preamble, the chat template's start (here the demo model
# given Zephyr's layout), baked as a first packet 'chat-preamble' as it is; kvserve-once --chat
# takes it as its preamble instead of prefilling its own (the same answer either way) and refuses
# one baked for another system message; errors are one line.
. "$KV_CLI_LIB"
mkdir chat && for f in config.json model.safetensors tokenizer.json; do ln -s "$demo/$f" chat/$f; done
/usr/bin/python3 -c "
import json, sys
config = json.load(open(sys.argv[1]))
config['chat_template'] = (\"{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\"
    \"{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}\")
json.dump(config, open('chat/tokenizer_config.json', 'w'))" "$demo/tokenizer_config.json"
run() { "$@" 2>&1 | sed -e "s|$demo|DEMO|g" -e "s|$PWD|.|g"; echo "exit ${PIPESTATUS[0]}"; }
printf 'Ada Lovelace wrote the first published program, for the Analytical Engine.\n' > document.txt

kvbake -m chat --chat-preamble --system "Be brief." --no-bos document.txt -o store.kvc -q
kvinspect show store.kvc | awk 'NR > 13 && NF { print $1, $2, $3 }'
kvbake -m chat --no-bos document.txt -o plain.kvc -q
serve() { kvserve-once -m chat --chat --system "Be brief." --temp 0 -n 6 --ignore-eos -p "Who wrote it?" "$@"; }
serve --cache store.kvc > baked.txt
serve --cache plain.kvc > prefilled.txt
serve --cache store.kvc:chat-preamble --cache store.kvc:document.txt > selected.txt
cmp -s baked.txt prefilled.txt && echo "the baked preamble answers as the prefilled one"
cmp -s baked.txt selected.txt && echo "selected by id: the same"
run kvserve-once -m chat --chat --system "Be long." -p "Who wrote it?" --cache store.kvc
run kvbake -m chat --system "Be brief." document.txt -o x.kvc
run kvbake -m "$demo" --chat-preamble document.txt -o x.kvc
printf '{"id": "chat-preamble", "text": "hello"}\n' > clash.jsonl
run kvbake -m chat --chat-preamble clash.jsonl -o x.kvc
