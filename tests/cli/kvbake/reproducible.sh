# Same input, threads and flags give byte-identical files (kvbake, kvindex, kvpack); SOURCE_DATE_EPOCH pins the one
# timestamp (provenance), and greedy decoding repeats itself.
. "$KV_CLI_LIB"
for i in $(seq 6); do echo "{\"id\": \"d$i\", \"text\": \"Document $i says the code of Ada is 4861$i.\"}"; done > docs.jsonl
mkdir one two  # the command line is recorded: the same one, run in two places
(cd one && SOURCE_DATE_EPOCH=1700000000 kvbake -m "$demo" -q -t 2 ../docs.jsonl -o out.kvc)
sleep 1.1
(cd two && SOURCE_DATE_EPOCH=1700000000 kvbake -m "$demo" -q -t 2 ../docs.jsonl -o out.kvc)
cmp one/out.kvc two/out.kvc && echo identical
for place in one two; do  # and so do the tools after it
    (cd $place && SOURCE_DATE_EPOCH=1700000000 kvindex -q -t 2 out.kvc -o indexed.kvc &&
        SOURCE_DATE_EPOCH=1700000000 kvpack -q indexed.kvc -o packed.kvc)
done
cmp one/indexed.kvc two/indexed.kvc && cmp one/packed.kvc two/packed.kvc && echo "indexed and packed identical"
kvinspect show one/out.kvc | grep -o '2023-[0-9T:-]*Z'
for run in 1 2; do
    kvserve-once -m "$demo" --cache one/out.kvc --prompt "The code of Ada is" -n 8 --temp 0 -t 2
done | uniq | wc -l
SOURCE_DATE_EPOCH=yesterday kvbake -m "$demo" -q docs.jsonl -o three.kvc
echo "exit $?"
# The latest time a four-digit year can write, and beyond (gmtime fails, or the year overflows).
SOURCE_DATE_EPOCH=253402300799 kvbake -m "$demo" -q docs.jsonl -o four.kvc && kvinspect show four.kvc | grep -o '9999-[0-9T:-]*Z'
for epoch in 253402300800 99999999999999999999 -1 +5 ' 5'; do
    SOURCE_DATE_EPOCH=$epoch kvbake -m "$demo" -q docs.jsonl -o five.kvc 2>&1 | sed 's/, not .*//'
    echo "exit ${PIPESTATUS[0]}"
done
