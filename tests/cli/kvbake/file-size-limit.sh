# A full disk (here a file size limit) fails the write with the system's reason and leaves
# neither the output nor the temporary file behind.
. "$KV_CLI_LIB"
for i in $(seq 40); do echo "{\"id\": \"d$i\", \"text\": \"Document $i says the code of Ada is 4861$i.\"}"; done > docs.jsonl
(ulimit -f 16; kvbake -m "$demo" -q --zstd-level 0 docs.jsonl -o out.kvc)
echo "exit $?"
ls -A | grep -v '^std'
