# Listing a store reads no tensor, and reading one packet reads only its chunks: with every key
# and value chunk but those of 'doc-03' corrupted (located by h5py), show and a diff of doc-03
# still work, and check finds every other packet broken.
. "$KV_CLI_LIB"
if ! /usr/bin/python3 -c 'import h5py' 2>/dev/null; then
    echo "skipped: /usr/bin/python3 lacks h5py" >&2
    exit 77
fi
cp "$KV_SOURCE_DIR/tests/data/kvcache/good/0010_many_packets.kvc" good.kvc
cp good.kvc bad.kvc
HDF5_PLUGIN_PATH=$KV_BIN/../lib/hdf5-plugins /usr/bin/python3 - <<'PY'
import h5py
offsets = []
with h5py.File("bad.kvc", "r") as f:
    ids = [x.decode() for x in f["packet_index/id"][:]]
    for i, ident in enumerate(ids):
        if ident == "doc-03":
            continue
        for name in ("keys", "values"):
            dataset = f["packets/%08d/%s" % (i, name)].id
            for chunk in range(dataset.get_num_chunks()):
                info = dataset.get_chunk_info(chunk)
                offsets.append(info.byte_offset + info.size // 2)
with open("bad.kvc", "r+b") as stream:
    for offset in offsets:
        stream.seek(offset)
        byte = stream.read(1)[0]
        stream.seek(offset)
        stream.write(bytes([byte ^ 0xFF]))
PY
kvinspect show bad.kvc | grep -c '^doc-\|^naïve\|^with\|^日本語'
kvinspect diff -q --packet doc-03 good.kvc bad.kvc && echo "doc-03 same"
kvinspect check bad.kvc 2>&1 | grep -c "data error detected by Fletcher32 checksum"
