# kvbake killed with SIGKILL at random moments never leaves a file under the output name, or
# leaves a complete one (when the kill came after the rename).
. "$KV_CLI_LIB"
require_files "$stories/stories260K.bin" "$stories/tok512.bin"
for i in $(seq 200); do echo "{\"id\": \"d$i\", \"text\": \"Lily and Tom went to the park number $i to play.\"}"; done > docs.jsonl
for trial in $(seq 8); do
    rm -f out.kvc
    kvbake -m "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin" docs.jsonl -o out.kvc -q --batch-tokens 64 &
    pid=$!
    sleep "0.$((RANDOM % 9 + 1))"
    kill -9 $pid 2>/dev/null
    wait $pid 2>/dev/null
    if [ -e out.kvc ]; then
        kvinspect check out.kvc || { echo "trial $trial: corrupt out.kvc"; exit 1; }
    fi
done
echo ok
