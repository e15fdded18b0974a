# 'kvinspect FILE' is 'kvinspect show FILE': a summary from the index.
cp "$KV_SOURCE_DIR"/tests/data/kvcache/good/0006_compressed_and_adapter.kvc a.kvc
kvinspect a.kvc
