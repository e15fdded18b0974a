# SIGKILL at random moments during kvbake, kvindex (also in place), kvpack, kvinspect merge and
# kvinspect compress (also in place)
# never leaves a corrupt file under the output name and never changes the input.
. "$KV_CLI_LIB"
for i in $(seq 80); do
    echo "{\"id\": \"d$i\", \"text\": \"Document $i: the code of Ada is 4861$i and Bob lives in Paris.\"}"
done > docs.jsonl
kvbake -m "$demo" -q --no-bos docs.jsonl -o docs.kvc || exit 1
input_sum=$(sha256sum < docs.kvc)

# TOOL_COMMAND... with OUT as the output; kills it after a random 0-MAX_TENTHS tenths of a second.
trial() {
    local max_tenths=$1 output=$2
    shift 2
    "$@" &
    local pid=$!
    sleep "$((RANDOM % max_tenths / 10)).$((RANDOM % 10))"
    kill -9 "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    if [ -e "$output" ]; then
        kvinspect check "$output" >/dev/null || { echo "corrupt $output after: $*"; exit 1; }
    fi
    [ "$(sha256sum < docs.kvc)" = "$input_sum" ] || { echo "input changed by: $*"; exit 1; }
}
for round in 1 2 3 4 5; do
    rm -f out.kvc
    trial 30 out.kvc kvbake -m "$demo" -q --no-bos docs.jsonl -o out.kvc
    rm -f out.kvc
    trial 15 out.kvc kvindex -q docs.kvc -o out.kvc
    rm -f out.kvc
    trial 8 out.kvc kvpack -q docs.kvc -o out.kvc
    rm -f out.kvc
    trial 3 out.kvc kvinspect merge docs.kvc -o out.kvc
    rm -f out.kvc
    trial 10 out.kvc kvinspect compress --method knorm --ratio 0.5 docs.kvc -o out.kvc
    rm -f out.kvc
    trial 30 out.kvc kvinspect compress --method snapkv --ratio 0.5 -m "$demo" docs.kvc -o out.kvc
    cp docs.kvc inplace.kvc
    trial 10 inplace.kvc kvinspect compress --method cur --ratio 0.3 inplace.kvc -o inplace.kvc
    [ -e inplace.kvc ] || { echo "in-place kvinspect compress lost its input"; exit 1; }
    # In place: the file under the name is always the old one or the new one, whole.
    cp docs.kvc inplace.kvc
    trial 15 inplace.kvc kvindex -q inplace.kvc -o inplace.kvc
    [ -e inplace.kvc ] || { echo "in-place kvindex lost its input"; exit 1; }
done
echo "no corrupt output, input unchanged"
