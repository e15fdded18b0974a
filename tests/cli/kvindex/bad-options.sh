. "$KV_CLI_LIB"
kvindex --promotion-first 0 - -o /dev/null < /dev/null 2>&1
echo "exit $?"
