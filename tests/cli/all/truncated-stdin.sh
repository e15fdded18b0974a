# A cache cut short on its way through a pipe (the writer died) is refused by every reader with a
# one-line error, exit 1, and nothing is written.
. "$KV_CLI_LIB"
for i in $(seq 20); do echo "{\"id\": \"d$i\", \"text\": \"Document $i: the code of Ada is 4861$i.\"}"; done > docs.jsonl
kvbake -m "$demo" -q --no-bos docs.jsonl -o docs.kvc
size=$(stat -c %s docs.kvc)
for cut in 0 100 $((size / 2)) $((size - 1)); do
    for tool in "kvinspect show -" "kvinspect check -" "kvindex -q - -o out.kvc" "kvpack -q - -o out.kvc" \
        "kvserve-once -m $demo --cache - -p x -n 1"; do
        head -c "$cut" docs.kvc | $tool > /dev/null 2> err
        status=$?
        echo "${tool%% -*} $cut: exit $status, $(wc -l < err) line(s)$([ -e out.kvc ] && echo ', out.kvc written')"
    done
done | sed "s/ $((size / 2)):/ half:/; s/ $((size - 1)):/ all-but-one:/"
