# Interoperability both ways, with h5py: files the C++ writer makes (kvinspect merge rewrites
# h5py-written corpus files) read back in h5py tensor for tensor equal to the originals, with
# the layout of formats/kvcache.md; and kvinspect export's safetensors, parsed with numpy alone,
# hold the same tensors.
. "$KV_CLI_LIB"
require_h5py
corpus=$KV_SOURCE_DIR/tests/data/kvcache/good
cases="0001_minimal 0002_f32_zstd 0003_bf16 0004_f16 0006_compressed_and_adapter 0007_gzip_big_endian_earliest 0010_many_packets"
for name in $cases; do
    kvinspect merge "$corpus/$name.kvc" -o "$name.kvc" || exit 1
    kvinspect export --to safetensors "$name.kvc" -o "$name.safetensors" || exit 1
done
/usr/bin/python3 - "$corpus" $cases <<'PY'
import json, struct, sys
import h5py, numpy as np

corpus, names = sys.argv[1], sys.argv[2:]
ST = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "I32": "<i4", "I64": "<i8"}

def text(value):
    return value.decode() if isinstance(value, bytes) else str(value)

def safetensors(path):
    data = open(path, "rb").read()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        raw = data[8 + size + begin:8 + size + end]
        tensors[name] = np.frombuffer(raw, dtype=ST[entry["dtype"]]).reshape(entry["shape"])
    return header["__metadata__"], tensors

total = 0
for name in names:
    with h5py.File("%s/%s.kvc" % (corpus, name), "r") as old, h5py.File(name + ".kvc", "r") as new:
        for key in ("format", "dtype", "keys_after_rope", "complete"):
            assert text(old.attrs[key]) == text(new.attrs[key]), (name, key)
        assert text(new.attrs["format_version"]) == "1.7", name  # with tensor_layout
        for key, value in old["model"].attrs.items():
            assert text(value) == text(new["model"].attrs[key]) or float(value) == float(new["model"].attrs[key]), (name, key)
        assert text(new["provenance"].attrs["tool"]) == "kvinspect"
        ids = [text(x) for x in old["packet_index/id"][:]]
        assert ids == [text(x) for x in new["packet_index/id"][:]], name
        for key in ("logical_length", "stored_length", "header_tokens", "trailer_tokens"):
            assert (old["packet_index"][key][:] == new["packet_index"][key][:]).all(), (name, key)
        meta, tensors = safetensors(name + ".safetensors")
        assert meta["dtype"] == text(new.attrs["dtype"]), name
        assert [p["id"] for p in json.loads(meta["packets"])] == ids, name
        dtype = text(new.attrs["dtype"])
        for i, ident in enumerate(ids):
            a, b = old["packets/%08d" % i], new["packets/%08d" % i]
            assert text(b.attrs["id"]) == ident
            # /packet_ids: a soft link named by the id leads h5py to the packet's group.
            link = "%2E" if ident == "." else ident.replace("%", "%25").replace("/", "%2F")
            assert new["packet_ids"].get(link, getlink=True).path == "/packets/%08d" % i, ident
            assert text(new["packet_ids"][link].attrs["id"]) == ident, ident
            for key in ("token_ids", "positions", "keys", "values"):
                x, y = a[key][...], b[key][...]
                assert x.shape == y.shape and (x == y).all(), (name, ident, key)
                assert (tensors["%s.%s" % (ident, key)] == x).all(), (name, ident, key, "export")
            keys = b["keys"]
            want = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "bf16": np.dtype("<u2")}[dtype]
            assert keys.dtype == want, (name, keys.dtype)
            if dtype == "bf16":
                assert text(keys.attrs["dtype"]) == "bf16"
            stored = keys.shape[2]
            # 1.7: chunks of up to 1 MiB of one plane, at least 256 tokens (section 7).
            tokens = max(256, (1 << 20) // (keys.shape[3] * keys.dtype.itemsize))
            assert keys.chunks == (1, 1, min(tokens, stored), keys.shape[3]), keys.chunks
            assert text(new.attrs["tensor_layout"]) == "chunks-1mib", name
            assert "32015" in keys._filters and "fletcher32" in keys._filters, keys._filters
            total += 1
print("%d files, %d packets: equal" % (len(names), total))
PY
