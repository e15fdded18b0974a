# kvinspect export with the store itself as output is refused before any work (exit 2): the
# store is untouched.
. "$KV_CLI_LIB"
cp "$KV_SOURCE_DIR"/tests/data/kvcache/good/0006_compressed_and_adapter.kvc a.kvc
cp a.kvc a.copy
kvinspect export --to safetensors a.kvc -o a.kvc 2>&1
echo "exit $?"
cmp -s a.kvc a.copy && echo "a.kvc untouched"
