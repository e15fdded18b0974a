# Different packet sets make files different; --packet compares one.
cp "$KV_SOURCE_DIR"/tests/data/kvcache/good/0002_f32_zstd.kvc a.kvc
cp "$KV_SOURCE_DIR"/tests/data/kvcache/good/0006_compressed_and_adapter.kvc b.kvc
kvinspect merge a.kvc b.kvc -o ab.kvc
kvinspect diff --packet doc-2 a.kvc ab.kvc || exit 3
kvinspect diff a.kvc ab.kvc
