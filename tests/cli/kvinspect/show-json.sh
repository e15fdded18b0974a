cp "$KV_SOURCE_DIR"/tests/data/kvcache/good/0010_many_packets.kvc a.kvc
kvinspect show --json a.kvc
