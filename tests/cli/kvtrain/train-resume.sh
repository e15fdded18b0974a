# kvtrain on the demo model: a run stopped by --max-steps and continued with --resume ends with
# the same adapter as one uninterrupted run; the teacher's answers are reused, and a torn record
# at the end of the teacher file (an interrupted run) is cut off and answered again.
. "$KV_CLI_LIB"
kvtasks bios --tokens 256 --count 4 --seed 5 -o data.jsonl
train() { kvtrain -m "$demo" --data data.jsonl --epochs 2 --batch 2 --answer-stop newline \
    --answer-tokens 8 --teacher-file teacher.bin -t 2 --json "$@"; }
field() { /usr/bin/python3 -c "import json,sys; print(json.load(sys.stdin)['$1'])"; }
train -o whole.kvc > whole.json
echo "answered $(field teacher_answered < whole.json), steps $(field steps < whole.json)/$(field total_steps < whole.json)"
train -o part.kvc --max-steps 3 > part.json
echo "first part: reused $(field teacher_reused < part.json), steps $(field steps < part.json)"
train -o part.kvc --resume > rest.json
echo "resumed: steps $(field steps < rest.json)"
whole=$(field adapter_fingerprint < whole.json)
[ "$whole" = "$(field adapter_fingerprint < rest.json)" ] && echo "same adapter as one run"
kvinspect show part.kvc | grep -c "adapter:     8 + 8 soft tokens of width 256, fingerprint $whole, trained 4 of 4 steps"
kvinspect check part.kvc && echo "check: sound"
# An interrupted teacher write: the last record loses its end.
size=$(stat -c %s teacher.bin)
truncate -s $((size - 7)) teacher.bin
train -o again.kvc > again.json
echo "after a torn record: answered $(field teacher_answered < again.json), reused $(field teacher_reused < again.json)"
[ "$whole" = "$(field adapter_fingerprint < again.json)" ] && echo "same adapter again"
