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
