# bake | pack | serve in one pipe decodes as the same steps through files.
. "$KV_CLI_LIB"
printf '{"id":"a","text":"Ada lives in Oslo.\\n"}\n{"id":"b","text":"Bruno lives in Lima.\\n"}\n' > docs.jsonl
q="Question: Where does Bruno live? Answer: Bruno lives in"
kvbake -m "$demo" --no-bos docs.jsonl -o docs.kvc -q
kvpack docs.kvc -o packed.kvc -q
kvserve-once -m "$demo" --cache packed.kvc --prompt "$q" -n 8 --temp 0 > from-files.txt
kvbake -m "$demo" --no-bos docs.jsonl -o - -q | kvpack - -o - -q |
    kvserve-once -m "$demo" --cache - --prompt "$q" -n 8 --temp 0 > from-pipe.txt
cmp from-files.txt from-pipe.txt && echo same
