cp "$KV_SOURCE_DIR"/tests/data/kvcache/good/0002_f32_zstd.kvc a.kvc
kvinspect diff a.kvc nope.kvc
