# The README's main command, scripts/demo, on the committed demo model: documents generated with
# a pass key hidden in one, each baked on its own, indexed, packed and decoded with IceCache in
# one pipe. It prints the answer on stdout and the expected one on stderr; both are shown here,
# for two seeds (two depths of the key).
. "$KV_CLI_LIB"
export KV_BUILD_DIR=$KV_BIN/..
for seed in 1 4; do
    answer=$("$KV_SOURCE_DIR/scripts/demo" "$seed" 2>stderr.txt)
    echo "seed $seed: exit $?, answer '$answer', $(grep '^expected:' stderr.txt)"
done
