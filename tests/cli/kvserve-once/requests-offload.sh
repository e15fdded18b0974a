# kvserve-once --requests with --offload disk: each request's packets are copied from the store
# into the temporary file plane by plane, as for one question, and none are kept in memory, so
# every request reads its packets again (none come from memory). The answers are the ones the
# same requests get with the packets in memory (full attention and IceCache with the prompt
# through the sparse attention, as the disk tier always runs it); a bad request between good
# ones fails alone, and no temporary file is left after the job.
. "$KV_CLI_LIB"
bake_requests_store
/usr/bin/python3 - > requests.jsonl <<'PY'
import json
tasks = [json.loads(line) for line in open("data.jsonl")]
def packets(task, order):
    return [f"store.kvc:{task['id']}/{i}" for i in order]
sparse = {"attention": "icecache", "budget": 64, "dense_layers": 0, "sparse_prompt": True}
for line in (
        {"id": "q0", "cache": packets(tasks[0], [0, 1, 2]), "prompt": tasks[0]["question"]},
        {"id": "q1", "cache": packets(tasks[1], [2, 0, 1]), "prompt": tasks[1]["question"],
         **sparse},
        {"id": "missing", "cache": packets(tasks[0], [0]) + ["store.kvc:nothing"],
         "prompt": tasks[0]["question"]},
        {"id": "q0 again", "cache": packets(tasks[0], [0, 1, 2]), "prompt": tasks[0]["question"],
         **sparse}):
    print(json.dumps(line))
PY
serve() { kvserve-once -m "$demo" -t 1 -n 8 --temp 0 --ignore-eos --requests requests.jsonl "$@"; }
serve --stats host-totals.json > host.jsonl
echo "host: exit $?"
serve --offload disk --offload-dir . --stats disk-totals.json > disk.jsonl
echo "disk: exit $?"
/usr/bin/python3 - <<'PY'
import json
host, disk = ([json.loads(line) for line in open(f)] for f in ("host.jsonl", "disk.jsonl"))
for h, d in zip(host, disk):
    if "error" in d:
        print(d["id"], "fails alone:", d["error"] == h["error"], "| line", d["line"])
        continue
    s = d["stats"]
    print(d["id"], "same answer:", d["text"] == h["text"], "|", repr(d["text"]),
          "| offload", s["offload"], "| packets read", s["packets_read"],
          "from memory", s["packets_from_memory"],
          "| file holds the cache:", s["offloaded_bytes"] >= s["cache_bytes_read"])
totals = {f: json.load(open(f"{f}-totals.json")) for f in ("host", "disk")}
for name, t in totals.items():
    print(name, {k: t[k] for k in ("requests", "answered", "failed", "packets_read",
                                    "packets_from_memory", "kept_bytes")})
PY
echo "no temporary file left: $(ls -A | grep -c kvtools-offload)"
