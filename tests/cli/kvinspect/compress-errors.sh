# Bad compression requests: one line naming the problem, usage errors exit 2, data errors 1, and
# nothing is written.
. "$KV_CLI_LIB"
echo '{"id": "a", "text": "The code of Ada is 48611 and Bob lives in Paris."}' > docs.jsonl
kvbake -m "$demo" -q docs.jsonl -o docs.kvc || exit 1
kvinspect compress --method knorm --ratio 0.5 docs.kvc -o ragged.kvc || exit 1
try() { "$@" 2>&1; echo "exit $?"; }
try kvinspect compress --method snapkv --ratio 0.5 docs.kvc -o out.kvc
try kvinspect compress --method knorm docs.kvc -o out.kvc
try kvinspect compress --method knorm --ratio 0.5 --keep-tokens 3 docs.kvc -o out.kvc
try kvinspect compress --method knorm --ratio 1 docs.kvc -o out.kvc
try kvinspect compress --method zip --ratio 0.5 docs.kvc -o out.kvc
try kvinspect compress --method snapkv --kernel-size 4 --ratio 0.5 -m "$demo" docs.kvc -o out.kvc
try kvinspect compress --method knorm --ratio 0.5 --packet nope docs.kvc -o out.kvc
try kvinspect compress --method knorm --ratio 0.5 ragged.kvc -o out.kvc
kvinspect compress --method streaming --keep-tokens 5 docs.kvc -o uniform.kvc
try kvinspect compress --method observed --ratio 0.5 -m "$demo" uniform.kvc -o out.kvc
try kvbake -m "$demo" -q docs.jsonl --ratio 0.5 -o out.kvc
[ -e out.kvc ] && echo "out.kvc was written"
exit 0
