# Values that are not finite: show reads the file, check reports them.
kvinspect show - < "$KV_SOURCE_DIR"/tests/data/kvcache/broken/0010_nan_values.kvc > /dev/null || exit 3
kvinspect check - < "$KV_SOURCE_DIR"/tests/data/kvcache/broken/0010_nan_values.kvc
