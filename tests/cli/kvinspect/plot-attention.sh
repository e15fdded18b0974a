# kvinspect plot attention: the question's attention over a packed context, per layer and per
# packet, as SVG (valid XML, one panel per layer and the mean) and JSON whose shares add up to 1.
. "$KV_CLI_LIB"
require_h5py
kvtasks niah --tokens 256 --count 1 --documents 3 --seed 4 -o data.jsonl
kvtasks bake-input data.jsonl -o docs.jsonl
kvbake -m "$demo" --no-bos docs.jsonl -o plain.kvc -q
question=$(/usr/bin/python3 -c "import json; print(json.loads(open('data.jsonl').readline())['question'])")
kvinspect plot attention -m "$demo" --cache plain.kvc:niah-256-0/0 --cache plain.kvc:niah-256-0/1 \
    --cache plain.kvc:niah-256-0/2 --prompt "$question" --svg plain.svg --json > plain.json
/usr/bin/python3 - <<'PY'
import json
import xml.etree.ElementTree as ET
svg = ET.parse("plain.svg").getroot()
texts = [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")]
print("panels:", [t for t in texts if t and (t.startswith("layer") or t == "mean")])
print("title:", texts[0])
report = json.load(open("plain.json"))
for layer in range(report["layers"]):
    total = report["preamble"][layer] + report["prompt"][layer] + sum(
        p["header"][layer] + p["document"][layer] + p["trailer"][layer] for p in report["packets"])
    assert abs(total - 1) < 1e-4, total
print("every layer's shares add up to 1 over BOS, packets and the question")
print("packets:", [(p["id"], p["first_slot"], p["stored"]) for p in report["packets"]])
PY
kvinspect plot attention -m "$demo" --prompt "$question" --svg x.svg 2>&1; echo "exit $?"
kvinspect plot attention -m "$demo" --cache missing.kvc --prompt "$question" --svg x.svg 2>&1; echo "exit $?"
[ ! -e x.svg ] && echo "no figure written"
