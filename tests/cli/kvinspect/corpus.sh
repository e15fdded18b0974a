# kvinspect check on every file of the conformance corpus (tests/data/kvcache/expected.tsv):
# sound files silently with exit 0, broken files with exit 1 and the expected one-line message;
# show on every file ends with 0 or 1, never on a signal.
. "$KV_CLI_LIB"
corpus=$KV_SOURCE_DIR/tests/data/kvcache
status=0
while IFS=$'\t' read -r file code pattern; do
    case "$file" in '#'* | '') continue ;; esac
    kvinspect check "$corpus/$file" >stdout.txt 2>stderr.txt
    actual=$?
    message=$(cat stderr.txt)
    lines=$(wc -l <stderr.txt)
    # shellcheck disable=SC2053  # the right side is a pattern on purpose
    if [ "$actual" != "$code" ] || [ -s stdout.txt ] || [[ $message != $pattern ]] ||
        [ "$lines" != "$([ -n "$pattern" ] && echo 1 || echo 0)" ]; then
        echo "check $file: exit $actual (expected $code), stderr: $message"
        status=1
    fi
    kvinspect show "$corpus/$file" >/dev/null 2>&1
    actual=$?
    if [ "$actual" -gt 1 ]; then
        echo "show $file: exit $actual"
        status=1
    fi
done <"$corpus/expected.tsv"
exit $status
