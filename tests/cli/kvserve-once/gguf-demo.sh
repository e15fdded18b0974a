# The demo model converted to GGUF (tests/tools/to_gguf.py, as llama.cpp's converter would) gives
# its folder's continuation: BF16 in bf16, and Q8_0 (dequantised to f32) the folder's in f32.
# llama.cpp gives that f32 text for the F32, F16 and BF16 files; with Q8_0 weights it also
# quantises the activations to 8 bits, and its text leaves this one at the third token.
. "$KV_CLI_LIB"
/usr/bin/python3 -c 'import numpy' 2>/dev/null || { echo "skipped: /usr/bin/python3 lacks numpy" >&2; exit 77; }
"$KV_SOURCE_DIR/tests/tools/to_gguf.py" "$demo" demo-bf16.gguf --type bf16
"$KV_SOURCE_DIR/tests/tools/to_gguf.py" "$demo" demo-q8_0.gguf --type q8_0
prompt="The code of Ada is"
for model in "$demo" demo-bf16.gguf; do
    kvserve-once -m "$model" --prompt "$prompt" -n 24 --temp 0
    echo
done
for model in "$demo" demo-q8_0.gguf; do
    kvserve-once -m "$model" --dtype f32 --prompt "$prompt" -n 24 --temp 0
    echo
done
