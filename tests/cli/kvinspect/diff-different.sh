# f32 against bf16: the dtype is a remark, the rounding a difference.
cp "$KV_SOURCE_DIR"/tests/data/kvcache/good/0002_f32_zstd.kvc f32.kvc
cp "$KV_SOURCE_DIR"/tests/data/kvcache/good/0003_bf16.kvc bf16.kvc
kvinspect diff f32.kvc bf16.kvc
