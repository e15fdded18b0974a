# Every option a tool's --help lists is documented in its man page, and every man page of a
# tool names its options with the same spelling.
. "$KV_CLI_LIB"
status=0
for tool in "$KV_BIN"/kv*; do
    name=$(basename "$tool")
    case "$name" in kv_*) continue ;; esac
    page="$KV_SOURCE_DIR/man/$name.1"
    if [ ! -f "$page" ]; then
        echo "$name: no man page $page"
        status=1
        continue
    fi
    # troff writes a dash as \- ; undo that before matching.
    documented=$(sed 's/\\-/-/g' "$page")
    for option in $("$tool" --help | grep -oE -- '--[a-z][a-z0-9-]*' | sort -u); do
        if ! grep -qF -- "$option" <<<"$documented"; then
            echo "$name: $option is in --help but not in man/$name.1"
            status=1
        fi
    done
done
exit $status
