cp "$KV_SOURCE_DIR"/tests/data/kvcache/good/0002_f32_zstd.kvc a.kvc
kvinspect merge a.kvc -o b.kvc --zstd-level 0
kvinspect diff a.kvc b.kvc
