# kvserve-once --chat: the prompt is the user's message in the model's own chat template (here
# the demo model given Zephyr's layout in its tokenizer_config.json), with the generation prompt,
# and the model reads exactly what the template renders (BOS written by the template, none added);
# with --document the template's start goes before the document and the prompt ends the user's
# turn; with --cache it is prefilled before the packets. A model without a template and --system
# without --chat are refused.
. "$KV_CLI_LIB"
mkdir chat && for f in config.json model.safetensors tokenizer.json; do ln -s "$demo/$f" chat/$f; done
/usr/bin/python3 -c "
import json, sys
config = json.load(open(sys.argv[1]))
config['chat_template'] = (\"{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\"
    \"{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}\")
json.dump(config, open('chat/tokenizer_config.json', 'w'))" "$demo/tokenizer_config.json"
serve() { kvserve-once --temp 0 -n 6 --ignore-eos "$@"; }
run() { "$@" 2>&1 | sed -e "s|$demo|DEMO|g" -e "s|$PWD|.|g"; echo "exit ${PIPESTATUS[0]}"; }

serve -m chat --chat --system "Be brief." -p "Who was Ada Lovelace?" --echo > chat.txt
rendered=$'<s><|system|>\nBe brief.</s>\n<|user|>\nWho was Ada Lovelace?</s>\n<|assistant|>\n'
serve -m chat --no-bos -p "$rendered" --echo > by-hand.txt
head -c ${#rendered} chat.txt | cmp -s - <(printf '%s' "$rendered") && echo "echoed the rendered prompt"
cmp -s chat.txt by-hand.txt && echo "--chat = the rendered prompt without BOS added"
serve -m chat -p "Who was Ada Lovelace?" > plain.txt
cmp -s chat.txt plain.txt || echo "--chat changes the answer"

# --document: the template's start, the document, the question, the end of the user's turn.
printf 'Ada Lovelace wrote the first published program, for the Analytical Engine.\n' > document.txt
serve -m chat --chat --document document.txt -p "Who wrote it?" > chat-document.txt
{ printf '<s><|user|>\n'; cat document.txt; } > wrapped.txt
serve -m chat --no-bos --document wrapped.txt -p $'Who wrote it?</s>\n<|assistant|>\n' > by-hand-document.txt
cmp -s chat-document.txt by-hand-document.txt && echo "--chat --document = the template around the document"

# --cache: KV Packet's preamble, the template's start, prefilled before the packets instead of
# BOS: as if it were baked as a first packet of its own.
kvbake -m chat --no-bos document.txt -o document.kvc -q
serve -m chat --chat --cache document.kvc -p "Who wrote it?" --stats stats.json > chat-cache.txt
printf '<s><|user|>\n' > start.txt
kvbake -m chat --no-bos start.txt -o start.kvc -q
serve -m chat --no-bos --cache start.kvc --cache document.kvc -p $'Who wrote it?</s>\n<|assistant|>\n' > by-hand-cache.txt
cmp -s chat-cache.txt by-hand-cache.txt && echo "--chat --cache = the template's start as a first packet"
/usr/bin/python3 -c "
import json; s = json.load(open('stats.json'))
print('context:', s['context_tokens'], '= start', s['context_tokens'] - s['cache_tokens'] - s['prompt_tokens'], '+ packet', s['cache_tokens'], '+ prompt', s['prompt_tokens'])"

run kvserve-once -m "$demo" --chat -p hi
run kvserve-once -m chat --system "Be brief." -p hi
