# Binary cache data is never written to a terminal unless forced (as zstd does): exit 2 with a
# hint, and nothing written. `script` gives the command a terminal for stdout.
. "$KV_CLI_LIB"
command -v script >/dev/null || { echo "skipped: script(1) is absent" >&2; exit 77; }
printf 'Ada lives in Oslo.\n' > doc.txt
kvbake -m "$demo" --no-bos doc.txt -o doc.kvc -q
script -qec "kvpack doc.kvc" /dev/null | tr -d '\r'
echo "exit ${PIPESTATUS[0]}"
