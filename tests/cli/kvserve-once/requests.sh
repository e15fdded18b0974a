# kvserve-once --requests: the requests of requests.jsonl (good lines and bad ones) served by one
# process over a store baked here. One line out per request, in input order: answers with their
# token counts and packets (read from the store, or kept in memory since an earlier request),
# errors naming the request's line; the job goes on after a failed request and exits 1. Every
# answer is the one kvserve-once gives the same question alone. A prompt too long for the
# model's context fails its request only; standard input serves as the requests file.
. "$KV_CLI_LIB"
bake_requests_store
cp "$KV_CASE_DIR/requests.jsonl" .
# A prompt longer than the demo model's 32,768 positions, as the last request.
/usr/bin/python3 -c '
import json
print(json.dumps({"id": "too long", "cache": ["store.kvc:niah-256-0/0"], "prompt": "x " * 40000}))' \
    >> requests.jsonl
serve() { kvserve-once -m "$demo" -t 1 --seed 1 -n 8 --temp 0 "$@"; }
serve --requests requests.jsonl --stats totals.json > answers.jsonl
echo "exit $?"
/usr/bin/python3 - <<'PY'
import json
keep = ("prompt_tokens", "generated_tokens", "stop_reason", "cache_tokens", "context_tokens",
        "attention", "budget", "packets_read", "packets_from_memory")
for line in open("answers.jsonl"):
    answer = json.loads(line)
    if "stats" in answer:
        answer["stats"] = {k: answer["stats"][k] for k in keep if k in answer["stats"]}
    print(json.dumps(answer))
totals = json.load(open("totals.json"))
print({k: totals[k] for k in ("requests", "answered", "failed", "stores", "packets_read",
                              "packets_from_memory", "packets_evicted")})
PY
# Without reading ahead (--read-ahead 0: each request's packets read when it is served): the
# same lines, each packet read or found in memory as before.
serve --requests requests.jsonl --read-ahead 0 --stats totals-0.json > answers-0.jsonl
/usr/bin/python3 - <<'PY'
import json
def lines(path):
    answers = [json.loads(line) for line in open(path)]
    for answer in answers:
        if "stats" in answer:
            answer["stats"] = {k: answer["stats"][k] for k in
                               ("generated_tokens", "packets_read", "packets_from_memory",
                                "read_ahead")}
    return answers
ahead, alone = lines("answers.jsonl"), lines("answers-0.jsonl")
print("read ahead:", [a["stats"]["read_ahead"] for a in ahead if "stats" in a],
      json.load(open("totals.json"))["read_ahead"], "; with --read-ahead 0:",
      [a["stats"]["read_ahead"] for a in alone if "stats" in a],
      json.load(open("totals-0.json"))["read_ahead"])
for answer in ahead + alone:
    answer.get("stats", {}).pop("read_ahead", None)
print("the same lines with --read-ahead 0:", ahead == alone)
PY
# Neither read ahead nor kept (--read-ahead 0 --cache-memory 0): each packet read straight into
# the question's cache, as a question alone reads it; the same answers.
# The job's totals count them (they never pass through its cache of packets).
serve --requests requests.jsonl --read-ahead 0 --cache-memory 0 --stats totals-direct.json \
    > answers-direct.jsonl
/usr/bin/python3 - <<'PY'
import json
def texts(path):
    return [(a["id"], a.get("text"), a.get("stats", {}).get("generated_tokens"), "error" in a)
            for a in map(json.loads, open(path))]
direct = [json.loads(line) for line in open("answers-direct.jsonl")]
print("read in place, none from memory:",
      all(a["stats"]["packets_from_memory"] == 0 for a in direct if "stats" in a),
      "; the same answers:", texts("answers-direct.jsonl") == texts("answers-0.jsonl"))
totals = json.load(open("totals-direct.json"))
answered = [a["stats"] for a in direct if "stats" in a]
print("totals:", totals["packets_read"], "packets,",
      totals["packets_read"] == sum(s["packets_read"] for s in answered),
      totals["cache_bytes_read"] == sum(s["cache_bytes_read"] for s in answered))
PY
# The same questions one process each: the same text.
/usr/bin/python3 - > alone.sh <<'PY'
import json, shlex
options = {"attention": "--attention", "budget": "--budget", "dense_layers": "--dense-layers"}
for line in open("requests.jsonl"):
    request = json.loads(line) if line.startswith('{"id": "q') or line.startswith('{"id": 2') else None
    if not request:
        continue
    # -n as the request gives it, else the job's -n 8 (the option may be given once).
    words = ["alone", "-n", str(request.get("n_predict", 8)), "--prompt", request["prompt"]]
    for spec in request["cache"]:
        words += ["--cache", spec]
    for field, option in options.items():
        if field in request:
            words += [option, str(request[field])]
    words += ["--echo"] if request.get("echo") else []
    words += ["--sparse-prompt"] if request.get("sparse_prompt") else []
    print(" ".join(shlex.quote(w) for w in words))
PY
alone() { kvserve-once -m "$demo" -t 1 --seed 1 --temp 0 "$@"; }
while read -r command; do eval "$command"; done < alone.sh > alone.txt
/usr/bin/python3 - <<'PY'
import json
alone = open("alone.txt").read().split("\n")
answers = [json.loads(l) for l in open("answers.jsonl") if "text" in json.loads(l)]
print("answers as alone:", [a["text"] for a in answers] == alone[:len(answers)])
PY
# Requests from standard input; --cache-memory 0 keeps no packet.
head -1 requests.jsonl | serve --requests - --cache-memory 0 | cut -c1-40
serve --requests requests.jsonl --document docs.jsonl 2>&1; echo "exit $?"
serve --prompt x --cache-memory 1g 2>&1; echo "exit $?"
serve --prompt x --read-ahead 1 2>&1; echo "exit $?"
serve --requests requests.jsonl --offload disk --cache-memory 1g 2>&1; echo "exit $?"
serve --requests - --cache - < store.kvc 2>&1; echo "exit $?"
