# kvindex writes the keys and values compressed as its input's are, unless --zstd-level says
# otherwise: a store baked uncompressed (read fastest) stays uncompressed once indexed. A store of
# quantised packets only has no unquantised keys to go by: level 3, as before.
. "$KV_CLI_LIB"
require_h5py
printf '{"id":"a","text":"Ada lives in Oslo. Ada has a red boat.\\n"}\n' > docs.jsonl
kvbake -m "$demo" --no-bos docs.jsonl -o plain.kvc -q --zstd-level 0
kvbake -m "$demo" --no-bos docs.jsonl -o level5.kvc -q --zstd-level 5
kvindex plain.kvc -o plain-indexed.kvc -q
kvindex level5.kvc -o level5-indexed.kvc -q
kvindex plain.kvc -o plain-level1.kvc -q --zstd-level 1
kvindex - -o - -q < level5.kvc > piped.kvc
kvbake -m "$demo" --no-bos docs.jsonl -o int8.kvc -q --zstd-level 0 --quantize int8
kvindex int8.kvc -o int8-indexed.kvc -q
/usr/bin/python3 - <<'PY'
import h5py
for name in ("plain.kvc", "plain-indexed.kvc", "level5.kvc", "level5-indexed.kvc",
             "plain-level1.kvc", "piped.kvc", "int8.kvc", "int8-indexed.kvc"):
    with h5py.File(name, "r") as f:
        group = f["packets/00000000"]
        keys = group["keys"] if "keys" in group else group["quantized/key_codes"]
        filters = keys._filters
        level = filters["32015"][0] if "32015" in filters else 0
        print(name, "indexed" if "index" in group else "not indexed", "zstd level", level)
PY
