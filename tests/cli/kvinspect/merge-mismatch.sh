cp "$KV_SOURCE_DIR"/tests/data/kvcache/good/0002_f32_zstd.kvc f32.kvc
cp "$KV_SOURCE_DIR"/tests/data/kvcache/good/0003_bf16.kvc bf16.kvc
kvinspect merge f32.kvc bf16.kvc -o out.kvc
status=$?
[ ! -e out.kvc ] || echo "out.kvc was written"
exit $status
