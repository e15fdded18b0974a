# check reads every file, silent on sound ones, one line per problem on others.
cp "$KV_SOURCE_DIR"/tests/data/kvcache/good/0002_f32_zstd.kvc good.kvc
cp "$KV_SOURCE_DIR"/tests/data/kvcache/broken/0009_checksum.kvc bad.kvc
kvinspect check good.kvc bad.kvc good.kvc
