# Every option of every subcommand's --help is documented in man/kvinspect.1 (the check in
# tests/cli/all covers the top-level --help only).
page=$(sed 's/\\-/-/g' "$KV_SOURCE_DIR/man/kvinspect.1")
status=0
for sub in show check diff export merge compress; do
    grep -qF "$sub" <<<"$page" || { echo "$sub is not in man/kvinspect.1"; status=1; }
    for option in $(kvinspect "$sub" --help | grep -oE -- '--[a-z][a-z0-9-]*' | sort -u); do
        if ! grep -qF -- "$option" <<<"$page"; then
            echo "kvinspect $sub: $option is in --help but not in man/kvinspect.1"
            status=1
        fi
    done
done
exit $status
