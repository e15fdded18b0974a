# Bad input: an adapter from another model, a damaged adapter file, a store without an adapter,
# malformed training data, a resume with other settings, packets from different models: each a
# one-line error, exit 1 (2 for usage).
. "$KV_CLI_LIB"
require_h5py
kvtasks bios --tokens 256 --count 2 --seed 5 -o data.jsonl
kvtrain -m "$demo" --data data.jsonl --epochs 1 --batch 2 --answer-stop newline --answer-tokens 4 -o adapter.kvc -q
kvtasks bake-input data.jsonl -o docs.jsonl
run() { "$@" 2>&1 | sed -e 's/[0-9a-f]\{12,\}/FP/g' -e "s|$demo|DEMO|g"; echo "exit ${PIPESTATUS[0]}"; }

# Another model: the demo model with another norm epsilon has another fingerprint.
mkdir other && cp "$demo"/* other/ && sed -i 's/"rms_norm_eps": 1e-05/"rms_norm_eps": 1e-06/' other/config.json
run kvbake -m other --adapter adapter.kvc docs.jsonl -o x.kvc

# The vectors changed without the fingerprint: damaged.
cp adapter.kvc damaged.kvc
/usr/bin/python3 -c "
import h5py
with h5py.File('damaged.kvc', 'r+') as f:
    f['adapter/header'][0, 0] += 1.0"
run kvbake -m "$demo" --adapter damaged.kvc docs.jsonl -o x.kvc
run kvinspect check damaged.kvc

# Bytes flipped in the middle of the file.
cp adapter.kvc flipped.kvc
size=$(stat -c %s flipped.kvc)
printf '\xff\xff\xff\xff\xff\xff\xff\xff' | dd of=flipped.kvc bs=1 seek=$((size / 2)) conv=notrunc status=none
kvbake -m "$demo" --adapter flipped.kvc docs.jsonl -o x.kvc 2>/dev/null; echo "flipped: exit $?"

# A packet store is not an adapter.
kvbake -m "$demo" docs.jsonl -o store.kvc -q
run kvbake -m "$demo" --adapter store.kvc docs.jsonl -o x.kvc
[ ! -e x.kvc ] && echo "no output written"

# Training data and settings.
echo '{"documents": [], "question": "Q"}' > bad.jsonl
run kvtrain -m "$demo" --data bad.jsonl -o y.kvc
run kvtrain -m "$demo" --data data.jsonl --epochs 2 --batch 2 --answer-stop newline --answer-tokens 4 -o adapter.kvc --resume
run kvtrain -m "$demo" --data data.jsonl -o -
run kvtrain -m "$demo" --data data.jsonl -o z.kvc --resume

# Packets from different models.
kvbake -m other docs.jsonl -o other.kvc -q
run kvpack store.kvc other.kvc -o packed.kvc
