# Merge from standard input to standard output, then check and list the result.
cp "$KV_SOURCE_DIR"/tests/data/kvcache/good/0006_compressed_and_adapter.kvc b.kvc
kvinspect merge - b.kvc -o - < "$KV_SOURCE_DIR"/tests/data/kvcache/good/0002_f32_zstd.kvc > out.kvc
kvinspect check out.kvc
kvinspect show --json out.kvc | /usr/bin/python3 -c '
import json, sys
report = json.load(sys.stdin)
print([p["id"] for p in report["packets"]], report["provenance"]["tool"], report["provenance"]["command_line"])'
