cp "$KV_SOURCE_DIR"/tests/data/kvcache/good/0002_f32_zstd.kvc a.kvc
cp "$KV_SOURCE_DIR"/tests/data/kvcache/broken/0009_checksum.kvc b.kvc
kvinspect diff a.kvc b.kvc
