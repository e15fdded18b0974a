# scripts/demo-model/probe-recall, the check train-demo-model makes of each phase-1 attempt: the
# committed demo model recalls numbers digit by digit and passes; a folder that holds no model is
# a usage error, exit 2.
. "$KV_CLI_LIB"
export KV_BUILD_DIR=$KV_BIN/..
probe=$KV_SOURCE_DIR/scripts/demo-model/probe-recall
"$probe" "$demo" --threads 1 | sed "s|$demo|DEMO|"
echo "exit ${PIPESTATUS[0]}"
mkdir empty
"$probe" empty 2>&1 | tail -n 1
echo "exit ${PIPESTATUS[0]}"
