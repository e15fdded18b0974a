cp "$KV_SOURCE_DIR"/tests/data/kvcache/good/0002_f32_zstd.kvc a.kvc
cp a.kvc b.kvc
kvinspect merge a.kvc b.kvc -o out.kvc
