#!/usr/bin/python3
"""The reference side of the tokenizer conformance suite for sentencepiece tokenizer.model files:
the sentencepiece library itself (Debian's python3-sentencepiece).

Usage: /usr/bin/python3 ref_spm.py TOKENIZER_DIR CORPUS.jsonl > OUT.jsonl

For each line {"text": ...} it writes {"ids", "ids_special", "decoded", "decoded_special"}: the
ids of SentencePieceProcessor.encode, then with BOS and EOS added as transformers' LlamaTokenizer
adds them (add_bos_token, default true, and add_eos_token, default false, from
tokenizer_config.json when present), the decode of each, and the decode of the ids with
specials followed by the next line's (the last line's next is the first).
"""

import json
import os
import sys

import sentencepiece


def token_content(entry):
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    return None


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: ref_spm.py TOKENIZER_DIR CORPUS.jsonl")
    directory, corpus = sys.argv[1:]
    processor = sentencepiece.SentencePieceProcessor(
        model_file=os.path.join(directory, "tokenizer.model"))
    config = {}
    config_path = os.path.join(directory, "tokenizer_config.json")
    if os.path.exists(config_path):
        with open(config_path, encoding="utf-8") as file:
            config = json.load(file)
    bos, eos = processor.bos_id(), processor.eos_id()
    if token_content(config.get("bos_token")):
        bos = processor.piece_to_id(token_content(config["bos_token"]))
    if token_content(config.get("eos_token")):
        eos = processor.piece_to_id(token_content(config["eos_token"]))
    add_bos = config.get("add_bos_token", True) is not False and bos >= 0
    add_eos = config.get("add_eos_token", False) is True and eos >= 0
    plain, special = [], []
    with open(corpus, encoding="utf-8") as lines:
        for line in lines:
            if not line.strip():
                continue
            ids = processor.encode(json.loads(line)["text"])
            plain.append(ids)
            special.append(([bos] if add_bos else []) + ids + ([eos] if add_eos else []))
    out = sys.stdout
    for i, ids in enumerate(plain):
        joined = special[i] + special[(i + 1) % len(special)]
        out.write(json.dumps({
            "ids": ids,
            "ids_special": special[i],
            "decoded": processor.decode(ids),
            "decoded_special": processor.decode(special[i]),
            "decoded_joined": processor.decode(joined),
        }) + "\n")

if __name__ == "__main__":
    main()
