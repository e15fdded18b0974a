# On a terminal progress is one line rewritten in place (carriage returns, shown as ^M), ended
# before the summary; -q silences both. `script` gives the command a terminal.
. "$KV_CLI_LIB"
command -v script >/dev/null || { echo "skipped: script(1) is absent" >&2; exit 77; }
printf '{"id":"a","text":"Ada lives in Oslo.\\n"}\n{"id":"b","text":"Bruno lives in Lima.\\n"}\n' > docs.jsonl
times() { sed -E 's/[0-9]+ tokens\/s/R tokens\/s/g; s/in [0-9]+\.[0-9]{2} s/in T s/'; }
echo "default:"
script -qec "kvbake -m '$demo' --no-bos docs.jsonl -o a.kvc --batch-tokens 8" /dev/null | cat -v | times
echo "-q:"
script -qec "kvbake -m '$demo' --no-bos docs.jsonl -o b.kvc --batch-tokens 8 -q" /dev/null | cat -v
echo "end"
