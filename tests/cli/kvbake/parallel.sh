# scripts/bake-parallel bakes shards with GNU parallel and merges them into one store whose
# packets equal a single-process bake (to 1e-4: documents are packed into different forward
# passes, so float sums run in a different order).
. "$KV_CLI_LIB"
require_files "$stories/stories260K.bin" "$stories/tok512.bin"
command -v parallel >/dev/null || { echo "skipped: GNU parallel is not installed" >&2; exit 77; }
m=(-m "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin")
for i in 0 1 2 3 4 5; do echo "{\"id\": \"d$i\", \"text\": \"Lily went to the park $i times.\"}"; done > docs.jsonl
KV_BIN="$KV_BIN" "$KV_SOURCE_DIR/scripts/bake-parallel" -j 2 -o merged.kvc "${m[@]}" docs.jsonl
kvbake "${m[@]}" docs.jsonl -o single.kvc -q
kvinspect diff --tol 1e-4 merged.kvc single.kvc > /dev/null && echo same
