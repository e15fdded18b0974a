cp "$KV_SOURCE_DIR"/tests/data/kvcache/good/0002_f32_zstd.kvc f32.kvc
cp "$KV_SOURCE_DIR"/tests/data/kvcache/good/0003_bf16.kvc bf16.kvc
kvinspect diff -q --tol 0.02 f32.kvc bf16.kvc
