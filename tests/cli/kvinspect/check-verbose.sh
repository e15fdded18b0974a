# check -v adds one line per file after its problems: sound or how many problems, and its packets.
cp "$KV_SOURCE_DIR"/tests/data/kvcache/good/0002_f32_zstd.kvc good.kvc
cp "$KV_SOURCE_DIR"/tests/data/kvcache/broken/0009_checksum.kvc bad.kvc
kvinspect check -v good.kvc bad.kvc missing.kvc
echo "exit $?"
kvinspect check -v - < good.kvc
