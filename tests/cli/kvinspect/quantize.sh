# Quantised storage (formats/kvcache.md 6.6): int8 and int4 files are sound, smaller, close to the
# original, decode, and survive rewrites (kvindex) with their codes unchanged; h5py dequantises
# them to what kvtools reads; bad settings are refused.
. "$KV_CLI_LIB"
require_h5py
for i in 1 2 3; do
    text="Document $i says the code of Ada is 4861$i. Bob lives in Paris and keeps a red cat."
    echo "{\"id\": \"d$i\", \"text\": \"$text $text $text $text $text $text $text $text\"}"
done > docs.jsonl
kvbake -m "$demo" -q docs.jsonl -o docs.kvc --zstd-level 0 || exit 1
kvinspect compress --quantize int8 docs.kvc -o int8.kvc --zstd-level 0 --json | grep -oE '"(quantization|bytes_before|bytes_after)": [0-9"a-z+]*'
kvbake -m "$demo" -q docs.jsonl -o int4.kvc --zstd-level 0 --quantize int4 --residual-tokens 8
kvinspect check int8.kvc && kvinspect check int4.kvc && echo "both sound"
kvinspect show int4.kvc | awk '$1 ~ /^d[0-9]$/ {print $1, $4}'
/usr/bin/python3 -c '
import os
sizes = {n: os.path.getsize(n + ".kvc") for n in ("docs", "int8", "int4")}
print("int8 under 65%% of bf16 (1.25 bytes a value with group 32): %s, int4 under 45%%: %s" % (sizes["int8"] < 0.65 * sizes["docs"], sizes["int4"] < 0.45 * sizes["docs"]))'
kvinspect diff --tol 0.05 docs.kvc int8.kvc | tail -1
kvinspect diff --tol 0.6 docs.kvc int4.kvc | tail -1
kvserve-once -m "$demo" --cache int4.kvc --prompt " The code of Ada is" -n 4 --temp 0 >/dev/null && echo "int4 decodes"
# A rewrite keeps the codes: kvindex reads, indexes and writes the same codes back.
kvindex -q int4.kvc -o indexed.kvc
/usr/bin/python3 - <<'PY'
import h5py, numpy as np
with h5py.File("int4.kvc", "r") as a, h5py.File("indexed.kvc", "r") as b:
    same = all(np.array_equal(a["packets/%08d/quantized/%s" % (i, n)][:], b["packets/%08d/quantized/%s" % (i, n)][:])
               for i in range(3) for n in ("key_codes", "key_scales", "key_offsets", "key_residual", "value_codes"))
    print("codes unchanged by kvindex:", same, "| version", b.attrs["format_version"])
# h5py dequantises as the spec says and gets what kvtools exports.
with h5py.File("int4.kvc", "r") as f:
    q = f["packets/00000000/quantized"]
    codes = q["key_codes"][:]
    low, high = codes & 15, codes >> 4
    unpacked = np.stack([low, high], axis=-1).reshape(codes.shape[:-1] + (codes.shape[-1] * 2,))
    group = q.attrs["group_size"]
    scales = np.repeat(q["key_scales"][:], group, axis=-1)
    offsets = np.repeat(q["key_offsets"][:], group, axis=-1)
    values = unpacked.astype(np.float32) * scales + offsets
    bf16 = lambda x: ((x.view(np.uint32) + 0x7FFF + ((x.view(np.uint32) >> 16) & 1)) >> 16).astype(np.uint16)
    residual = q["key_residual"][:]
    mine = np.concatenate([bf16(values.astype(np.float32)), residual], axis=2)
np.save("h5py_keys.npy", mine)
PY
kvinspect export --to safetensors int4.kvc -o int4.safetensors
/usr/bin/python3 - <<'PY'
import json, struct, numpy as np
raw = open("int4.safetensors", "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8:8 + n])
entry = header["d1.keys"]
begin, end = entry["data_offsets"]
theirs = np.frombuffer(raw[8 + n + begin:8 + n + end], dtype=np.uint16).reshape(entry["shape"])
print("h5py dequantisation equals kvtools':", np.array_equal(np.load("h5py_keys.npy"), theirs))
PY
try() { "$@" 2>&1; echo "exit $?"; }
try kvinspect compress --quantize int8 --quant-group 5 docs.kvc -o bad.kvc
try kvindex -q docs.kvc -o bad.kvc --residual-tokens 4
try kvinspect compress docs.kvc -o bad.kvc
[ -e bad.kvc ] && echo "bad.kvc was written"
exit 0
