# A file written by kvbake is standard HDF5 + zstd: Debian's h5py reads every tensor, and they
# equal what kvinspect export writes to safetensors (f32 and bf16). Debian's python3-hdf5plugin
# 4.0.1 ships no filter binaries, so the zstd filter (32015) comes from kvtools' own HDF5 plugin,
# found through HDF5_PLUGIN_PATH (with pip's hdf5plugin, `import hdf5plugin` alone suffices).
. "$KV_CLI_LIB"
export HDF5_PLUGIN_PATH="$KV_BIN/../lib/hdf5-plugins"
require_files "$stories/stories260K.bin" "$stories/tok512.bin"
/usr/bin/python3 -c 'import h5py, hdf5plugin, numpy' 2>/dev/null || {
    echo "skipped: /usr/bin/python3 lacks h5py, hdf5plugin or numpy" >&2
    exit 77
}
m=(-m "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin")
printf '{"id": "a", "text": "Lily had a red ball."}\n{"id": "b", "text": "Tom saw a big dog in the park."}\n' > docs.jsonl
for dtype in f32 bf16; do
    kvbake "${m[@]}" docs.jsonl --dtype "$dtype" -o "docs-$dtype.kvc" -q
    kvinspect export --to safetensors "docs-$dtype.kvc" -o "docs-$dtype.safetensors"
    /usr/bin/python3 - "docs-$dtype.kvc" "docs-$dtype.safetensors" "$dtype" <<'PY'
import json, struct, sys
import h5py, hdf5plugin, numpy as np
kvc, st, dtype = sys.argv[1:]
raw = open(st, "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8:8 + n])
def tensor(name):
    entry = header[name]
    begin, end = entry["data_offsets"]
    np_dtype = {"F32": np.float32, "BF16": np.uint16, "I32": np.int32, "I64": np.int64}[entry["dtype"]]
    return np.frombuffer(raw[8 + n + begin:8 + n + end], dtype=np_dtype).reshape(entry["shape"])
with h5py.File(kvc, "r") as f:
    assert f.attrs["dtype"] == dtype, f.attrs["dtype"]
    ids = [i.decode() if isinstance(i, bytes) else i for i in f["packet_index/id"][()]]
    assert ids == ["a", "b"], ids
    for ordinal, pid in enumerate(ids):
        group = f[f"packets/{ordinal:08d}"]
        for name in ("keys", "values", "token_ids", "positions"):
            ours = group[name][()]
            exported = tensor(f"{pid}.{name}")
            assert ours.shape == exported.shape, (name, ours.shape, exported.shape)
            assert np.array_equal(ours, exported), name
        keys = group["keys"][()]
        if dtype == "bf16":
            keys = (keys.astype(np.uint32) << 16).view(np.float32)
        assert keys.shape[:2] == (5, 4) and keys.shape[3] == 8, keys.shape
        assert np.isfinite(keys).all() and np.abs(keys).max() > 0
print(dtype, "ok")
PY
done
