# kvindex adds an index to every packet (format 1.1) and changes nothing else; kvpack carries
# the indexes as segments shifted to their place in the context.
. "$KV_CLI_LIB"
printf '{"id":"a","text":"Ada lives in Oslo. Ada has a red boat.\\n"}\n{"id":"b","text":"Bruno lives in Lima.\\n"}\n' > docs.jsonl
kvbake -m "$demo" --no-bos docs.jsonl -o docs.kvc -q
kvindex docs.kvc -o indexed.kvc --json 2>/dev/null | grep -E '"(packets|indexes)"'
kvinspect diff docs.kvc indexed.kvc > /dev/null && echo "same packets"
kvpack indexed.kvc -o packed.kvc -q --json | grep '"indexed"'
/usr/bin/python3 - <<'PY'
import h5py
for name in ("docs.kvc", "indexed.kvc", "packed.kvc"):
    with h5py.File(name, "r") as f:
        group = f["packets/00000000"]
        segments = group["index/segments"][:].tolist() if "index" in group else None
        print(name, f.attrs["format_version"], segments)
PY
