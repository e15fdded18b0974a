# Helpers for CLI test cases: `. "$KV_CLI_LIB"` at the top of a case.

# The shared model directory (../shared/models or $KV_MODELS_DIR).
models=${KV_MODELS_DIR:-$KV_SOURCE_DIR/../shared/models}
stories=$models/stories260K

# Skips the case (exit 77) unless every named file exists.
require_files() {
    for file in "$@"; do
        if [ ! -e "$file" ]; then
            echo "skipped: $file is absent" >&2
            exit 77
        fi
    done
}

# kvtools' own demo model, committed in the repository: tests that use it always run.
demo=$KV_SOURCE_DIR/models/demo

# bench/kvtasks (the task generator) with Debian's Python.
kvtasks() {
    /usr/bin/python3 "$KV_SOURCE_DIR/bench/kvtasks" "$@"
}

# The store the --requests cases serve: two NIAH questions over 3 documents of 256 tokens each
# (data.jsonl), their documents baked with the demo model and indexed into store.kvc.
bake_requests_store() {
    kvtasks niah --tokens 256 --documents 3 --count 2 --seed 4 -o data.jsonl
    kvtasks bake-input data.jsonl -o docs.jsonl
    kvbake -m "$demo" --no-bos docs.jsonl -o store.kvc -q
    kvindex store.kvc -o store.kvc -q
}

# Skips the case (exit 77) unless Debian's Python has h5py and numpy, and points h5py at the zstd
# filter kvtools builds (Debian's hdf5plugin ships no filter binaries).
require_h5py() {
    if ! /usr/bin/python3 -c 'import h5py, numpy' 2>/dev/null; then
        echo "skipped: /usr/bin/python3 lacks h5py or numpy" >&2
        exit 77
    fi
    export HDF5_PLUGIN_PATH=$KV_BIN/../lib/hdf5-plugins
}
