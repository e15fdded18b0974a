# kvindex adds an index to every packet and changes nothing else: over every layer (format 1.1)
# with --dense-layers 0, and by default over the layers decoding queries (past the 2 dense ones:
# format 1.5, feature index-layers, a smaller file); kvpack carries the indexes as segments
# shifted to their place in the context, their layers with them.
. "$KV_CLI_LIB"
printf '{"id":"a","text":"Ada lives in Oslo. Ada has a red boat.\\n"}\n{"id":"b","text":"Bruno lives in Lima.\\n"}\n' > docs.jsonl
kvbake -m "$demo" --no-bos docs.jsonl -o docs.kvc -q
kvindex docs.kvc -o indexed.kvc --dense-layers 0 --json 2>/dev/null | grep -E '"(packets|indexes)"'
kvinspect diff docs.kvc indexed.kvc > /dev/null && echo "same packets"
kvpack indexed.kvc -o packed.kvc -q --json | grep '"indexed"'
kvindex docs.kvc -o default.kvc --json 2>/dev/null | grep -E '"(indexes|layers)"'
kvinspect diff docs.kvc default.kvc > /dev/null && echo "same packets"
kvpack default.kvc -o packed-default.kvc -q
/usr/bin/python3 - <<'PY'
import h5py
for name in ("docs.kvc", "indexed.kvc", "packed.kvc", "default.kvc", "packed-default.kvc"):
    with h5py.File(name, "r") as f:
        group = f["packets/00000000"]
        index = group["index"] if "index" in group else None
        segments = index["segments"][:].tolist() if index is not None else None
        layers = index["layers"][:].tolist() if index is not None and "layers" in index else None
        features = [x.decode() if isinstance(x, bytes) else x
                    for x in f.attrs.get("required_features", [])]
        levels = index["levels"].shape if index is not None else None
        print(name, f.attrs["format_version"], segments, layers, features, levels)
PY
