# On a terminal kvindex counts the packets on one line rewritten in place (carriage returns, shown
# as ^M); -q silences it. `script` gives the command a terminal.
. "$KV_CLI_LIB"
command -v script >/dev/null || { echo "skipped: script(1) is absent" >&2; exit 77; }
printf '{"id":"a","text":"Ada lives in Oslo.\\n"}\n{"id":"b","text":"Bruno lives in Lima.\\n"}\n' > docs.jsonl
kvbake -m "$demo" --no-bos docs.jsonl -o docs.kvc -q
echo "default:"
script -qec "kvindex docs.kvc -o a.kvc" /dev/null | cat -v
echo "-q:"
script -qec "kvindex docs.kvc -o b.kvc -q" /dev/null | cat -v
echo "end"
