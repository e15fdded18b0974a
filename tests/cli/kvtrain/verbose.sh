# kvtrain: by default a summary line; -v one progress line when the teacher is done and one per
# step, then the summary; -q nothing on stderr; -q and -v together are a usage error.
. "$KV_CLI_LIB"
for i in 1 2; do
    echo "{\"documents\": [\"Ada's code is 4861$i.\", \"Bob lives in Paris.\"], \"question\": \" Ada's code is\"}"
done > data.jsonl
train() { kvtrain -m "$demo" --data data.jsonl --header 2 --trailer 2 --epochs 2 --batch 1 \
    --answer-stop newline --answer-tokens 4 --teacher-file teacher.bin -t 2 "$@" 2>&1 |
    sed -E 's/[0-9]+\.[0-9]+ s/T s/g; s/, [0-9]+ s$/, T s/; s/loss [0-9.]+( -> [0-9.]+)?/loss L/; s/adapter [0-9a-f]{12}$/adapter F/'; }
echo "default:"
train -o a.kvc
echo "-v:"
train -o b.kvc -v
echo "-q:"
train -o c.kvc -q
echo "-q -v:"
train -o d.kvc -q -v
