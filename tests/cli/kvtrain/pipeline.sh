# The KV Packet pipeline: kvtrain -> kvbake --adapter -> kvpack -> kvserve-once. Packets start
# with the header's soft tokens (id -1) and record the adapter; packing keeps it.
. "$KV_CLI_LIB"
require_h5py
# The adapter's fingerprint below is that of AVX512-BF16 arithmetic: oneDNN's AMX kernels round
# bf16 products differently, so on a CPU with AMX tiles the trained adapter (and its hash) differs;
# on AVX2 (pipeline.stdout.exact.avx2) the products are float32 ones.
export DNNL_MAX_CPU_ISA=AVX512_CORE_BF16
kvtasks niah --tokens 256 --count 2 --documents 3 --seed 5 -o data.jsonl
kvtrain -m "$demo" --data data.jsonl --epochs 1 --batch 2 --header 4 --trailer 2 \
    --answer-stop newline --answer-tokens 8 -o adapter.kvc -q
kvtasks bake-input data.jsonl -o docs.jsonl
kvbake -m "$demo" --adapter adapter.kvc docs.jsonl -o packets.kvc -q
kvinspect show packets.kvc | awk 'NR > 13 && NF { print $1, $4 }' | head -3
/usr/bin/python3 - <<'PY'
import h5py
with h5py.File("packets.kvc", "r") as f, h5py.File("adapter.kvc", "r") as a:
    g = f["packets/00000000"]
    ids = g["token_ids"][:]
    print("soft tokens:", list(ids[:4]), "...", list(ids[-2:]), "document tokens >= 0:", bool((ids[4:-2] >= 0).all()))
    print("adapter recorded:", g.attrs["adapter_fingerprint"] == a["adapter"].attrs["fingerprint"])
    print("positions from 0:", g["positions"][0], "logical", g.attrs["logical_length"], "=", len(ids))
PY
kvpack packets.kvc:niah-256-0/0 packets.kvc:niah-256-0/1 packets.kvc:niah-256-0/2 -o context.kvc
kvinspect show context.kvc | awk 'NR > 13 && NF { print $2, $3, $4, $5 }'
question=$(/usr/bin/python3 -c "import json; print(json.loads(open('data.jsonl').readline())['question'])")
kvserve-once -m "$demo" --cache context.kvc --prompt "$question" -n 4 --temp 0 > answer.txt
[ -s answer.txt ] && echo "decoded an answer"
# Packets with an adapter and packets without one do not mix.
kvbake -m "$demo" --no-bos docs.jsonl -o plain.kvc -q
kvpack packets.kvc:niah-256-0/0 plain.kvc:niah-256-0/1 -o mixed.kvc 2>&1 | sed 's/adapter [0-9a-f]*/adapter H/g'
echo "exit ${PIPESTATUS[0]}"
kvserve-once -m "$demo" --cache plain.kvc:niah-256-0/0 --cache packets.kvc:niah-256-0/1 --prompt "$question" -n 2 2>&1 | sed 's/adapter [0-9a-f]*/adapter H/g'
echo "exit ${PIPESTATUS[0]}"
