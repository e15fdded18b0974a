# A truncated GGUF file is one line naming it and what is missing, never a crash.
. "$KV_CLI_LIB"
/usr/bin/python3 -c 'import numpy' 2>/dev/null || { echo "skipped: /usr/bin/python3 lacks numpy" >&2; exit 77; }
"$KV_SOURCE_DIR/tests/tools/to_gguf.py" "$demo" demo.gguf --type bf16
head -c 3000000 demo.gguf > cut.gguf
kvserve-once -m cut.gguf --prompt hi
