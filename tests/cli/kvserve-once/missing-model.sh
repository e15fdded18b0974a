kvserve-once -m nope.bin --tokenizer tok.bin --prompt hi
