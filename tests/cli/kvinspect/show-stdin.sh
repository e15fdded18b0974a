# '-' reads the cache from standard input (an HDF5 file image).
kvinspect show - < "$KV_SOURCE_DIR"/tests/data/kvcache/good/0003_bf16.kvc
