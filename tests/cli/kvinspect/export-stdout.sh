# export to a file and to standard output give the same bytes.
cp "$KV_SOURCE_DIR"/tests/data/kvcache/good/0004_f16.kvc a.kvc
kvinspect export --to safetensors a.kvc -o a.safetensors
kvinspect export --to safetensors - -o - < a.kvc > b.safetensors
cmp a.safetensors b.safetensors && echo same
