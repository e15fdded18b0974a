# Every scoring rule prunes each head to floor(T/2) tokens, keeps the logical length, and writes a
# sound file; rules whose heads choose differently store per-head positions (format 1.2), and
# h5py reads them as formats/kvcache.md 6.3 says.
. "$KV_CLI_LIB"
require_h5py
for i in 1 2 3; do
    text="Document $i."
    for fact in "the code of Ada is 4861$i" "Bob lives in Paris with a red cat" "the river runs to the sea" \
        "Carol keeps bees in the garden" "the train leaves at nine" "Dan paints the old barn blue"; do
        text="$text Note: $fact."
    done
    echo "{\"id\": \"d$i\", \"text\": \"$text $text\"}"
done > docs.jsonl
kvbake -m "$demo" -q docs.jsonl -o docs.kvc || exit 1
for method in random knorm streaming snapkv tova observed expected leverage cur; do
    kvinspect compress --method "$method" --ratio 0.5 -m "$demo" docs.kvc -o "$method.kvc" --json |
        /usr/bin/python3 -c '
import json, sys
r = json.load(sys.stdin)
print(r["method"], r["tokens_before"], "->", r["tokens_after"],
      "per-head" if any(p["per_head"] for p in r["packets"]) else "shared",
      "bytes halved" if abs(r["bytes_after"] * 2 - r["bytes_before"]) <= r["bytes_before"] // 20 else "bytes?")'
    kvinspect check "$method.kvc" || echo "$method: check failed"
done
/usr/bin/python3 - <<'PY'
import h5py, numpy as np
with h5py.File("knorm.kvc", "r") as f, h5py.File("docs.kvc", "r") as g:
    print("version", f.attrs["format_version"], "features", [x.decode() if isinstance(x, bytes) else x for x in f.attrs["required_features"]])
    p, q = f["packets/00000000"], g["packets/00000000"]
    lengths, positions = p["head_lengths"][:], p["head_positions"][:]
    s = p.attrs["stored_length"]
    print("logical", p.attrs["logical_length"], "stored", s, "head lengths", sorted(set(lengths.ravel().tolist())))
    ok = True
    keys, full = p["keys"][:], q["keys"][:]
    for l in range(lengths.shape[0]):
        for h in range(lengths.shape[1]):
            kept = positions[l, h, :lengths[l, h]]
            ok &= bool(np.all(np.diff(kept) > 0)) and bool(np.all(kept <= p["positions"][:]))
            ok &= bool(np.array_equal(keys[l, h, :len(kept)], full[l, h, kept]))  # the same keys
            norms = np.linalg.norm(((full[l, h].astype(np.uint32) << 16).view(np.float32)), axis=-1)
            ok &= bool(norms[kept].max() <= np.sort(norms)[len(kept) - 1] + 1e-6)  # the smallest
    print("per-head slots hold the smallest keys in position order:", ok)
with h5py.File("streaming.kvc", "r") as f:
    print("streaming: version", f.attrs["format_version"], "features" in f.attrs or "required_features" in f.attrs,
          f["packets/00000000/positions"][:6].tolist())
PY
