# An adapter file (kvcache(5) 6.7) keeps its /adapter through every rewrite: export writes its
# attributes and vectors (the fingerprint recomputed from the exported vectors is the file's),
# and merge, compress in place and kvindex leave it as it was (same fingerprint, same training).
. "$KV_CLI_LIB"
cp "$demo/adapter-mixture.kvc" adapter.kvc
fingerprint=$(kvinspect show --json adapter.kvc | /usr/bin/python3 -c 'import json, sys; print(json.load(sys.stdin)["adapter"]["fingerprint"])')
kvinspect export --to safetensors adapter.kvc -o adapter.safetensors
echo "export: exit $?"
/usr/bin/python3 - "$fingerprint" <<'PY'
import hashlib, json, struct, sys
data = open("adapter.safetensors", "rb").read()
size = struct.unpack("<Q", data[:8])[0]
header = json.loads(data[8:8 + size])
adapter = json.loads(header.pop("__metadata__")["adapter"])
body = data[8 + size:]
for name, tensor in sorted(header.items()):
    print(name, tensor["dtype"], tensor["shape"])
counts = f'{adapter["header_tokens"]} {adapter["trailer_tokens"]} {adapter["hidden_size"]}\n'
vectors = b"".join(body[header[name]["data_offsets"][0]:header[name]["data_offsets"][1]]
                   for name in ("adapter.header", "adapter.trailer") if name in header)
recomputed = hashlib.sha256(b"kvtools-adapter-v1\n" + counts.encode() + vectors).hexdigest()
print("fingerprint:", recomputed == adapter["fingerprint"] == sys.argv[1])
print("trained:", bool(adapter["training"]))
PY
adapter_of() { kvinspect show --json "$1" | /usr/bin/python3 -c 'import json, sys; a = json.load(sys.stdin).get("adapter"); print(a and (a["fingerprint"], a["training"]))'; }
kept=$(adapter_of adapter.kvc)
kvinspect merge adapter.kvc -o merged.kvc 2>&1
echo "merge: exit $?, adapter kept: $([ "$(adapter_of merged.kvc)" = "$kept" ] && echo yes)"
cp adapter.kvc indexed.kvc
kvindex -q indexed.kvc -o indexed.kvc 2>&1
echo "kvindex in place: exit $?, adapter kept: $([ "$(adapter_of indexed.kvc)" = "$kept" ] && echo yes)"
