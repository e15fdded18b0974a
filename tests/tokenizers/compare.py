#!/usr/bin/python3
"""Compares kvtools' output with the reference's for one tokenizer of the conformance suite.

Usage: compare.py NAME CORPUS.jsonl REFERENCE.jsonl KVTOOLS.jsonl [--show N]

Ids must be equal exactly, with add_special_tokens off and on; decoded texts must be equal to
the reference's (decode of the ids, special tokens skipped), with and without the special
tokens, and of the text's ids with special tokens followed by the next text's. Prints one
summary line, then every mismatch (the first N in full, default 50), and exits 1 if there is
any.
"""

import json
import sys


def load(path):
    with open(path, encoding="utf-8") as file:
        return [json.loads(line) for line in file if line.strip()]


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def main():
    args = sys.argv[1:]
    show = 50
    if "--show" in args:
        at = args.index("--show")
        show = int(args[at + 1])
        del args[at:at + 2]
    name, corpus_path, reference_path, kvtools_path = args
    corpus = load(corpus_path)
    reference = load(reference_path)
    kvtools = load(kvtools_path)
    if not (len(corpus) == len(reference) == len(kvtools)):
        print(f"{name}: line counts differ: corpus {len(corpus)}, reference {len(reference)}, "
              f"kvtools {len(kvtools)}")
        return 1

    ids_equal = decodes_equal = round_trips = kv_round_trips = 0
    mismatches = []
    for line, (item, ref, kv) in enumerate(zip(corpus, reference, kvtools), start=1):
        text = item["text"]
        problems = []
        for key in ("ids", "ids_special"):
            if ref[key] != kv[key]:
                at = first_difference(ref[key], kv[key])
                problems.append(f"{key} differ at {at}: reference {ref[key][max(0, at - 3):at + 6]}"
                                f" kvtools {kv[key][max(0, at - 3):at + 6]}"
                                f" (lengths {len(ref[key])} and {len(kv[key])})")
        if not problems:
            ids_equal += 1
        decode_problems = [
            f"{key}: reference {ref[key]!r} kvtools {kv[key]!r}"
            for key in ("decoded", "decoded_special", "decoded_joined") if ref[key] != kv[key]
        ]
        if not decode_problems:
            decodes_equal += 1
        round_trips += ref["decoded"] == text
        kv_round_trips += kv["decoded"] == text
        if problems or decode_problems:
            mismatches.append((line, item.get("category", "?"), text, problems + decode_problems))

    total = len(corpus)
    print(f"{name}: {total} strings, ids equal {ids_equal}/{total}, decodes equal "
          f"{decodes_equal}/{total} (decode(encode(text)) == text: reference {round_trips}, "
          f"kvtools {kv_round_trips})")
    for line, category, text, problems in mismatches[:show]:
        print(f"  line {line} [{category}] text {text!r}")
        for problem in problems:
            print(f"    {problem}")
    if len(mismatches) > show:
        print(f"  ... and {len(mismatches) - show} more mismatching strings")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
