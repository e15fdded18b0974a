# On a terminal the teacher's count and the training bar are each one line rewritten in place
# (carriage returns, shown as ^M), the last state of each kept, then the summary; -q silences all.
# `script` gives the command a terminal.
. "$KV_CLI_LIB"
command -v script >/dev/null || { echo "skipped: script(1) is absent" >&2; exit 77; }
for i in 1 2; do
    echo "{\"documents\": [\"Ada's code is 4861$i.\"], \"question\": \" Ada's code is\"}"
done > data.jsonl
train="kvtrain -m '$demo' --data data.jsonl --header 2 --trailer 2 --epochs 1 --batch 1"
train="$train --answer-stop newline --answer-tokens 4 --teacher-file teacher.bin -t 2"
echo "default:"
script -qec "$train -o a.kvc" /dev/null | cat -v |
    sed -E 's/, [0-9]+ s/, T s/g; s/loss [0-9.]+( -> [0-9.]+)?/loss L/g; s/[0-9]+\.[0-9] s/T s/; s/adapter [0-9a-f]{12}/adapter F/'
echo "-q:"
script -qec "$train -o b.kvc -q" /dev/null | cat -v
echo "end"
