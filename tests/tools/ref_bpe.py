#!/usr/bin/python3
"""An independent byte-level BPE, the reference the C++ tokenizer is checked against.

Standard library only (Debian's /usr/bin/python3). Python's re module has no \\p{L}, so the
GPT-2 and Llama 3 pre-tokenizer patterns are matched by hand below from unicodedata categories;
BPE is GPT-2's original loop (merge every occurrence of the best pair), not the priority queue
the C++ side uses.

    ref_bpe.py build DIR --style gpt2|llama3   learn merges from CORPUS, write DIR/tokenizer.json
    ref_bpe.py encode TOKENIZER_JSON TEXTS_JSON  print a JSON list of id lists, one per text
    ref_bpe.py nfc TEXTS_JSON                    print the texts in Unicode NFC
"""
import argparse
import collections
import json
import os
import sys
import unicodedata

CORPUS = """\
The quick brown fox jumps over the lazy dog. It's the dog's day; they're sure we've seen
what I'm saying, and you'll know we'd agree. THE DOG'S BONE WASN'T THERE!
In 2023, 1,234,567 people paid $89.99 each -- that's 110 million dollars... or is it?
Email: someone@example.com, path C:\\\\Users\\\\fox, code: x = y*2 + f(z)[3]; // done
Café au lait, naïve résumé, crème brûlée, façade, Ångström, Straße, Ærøskøbing.
Привет, как дела? Всё хорошо. Ελληνικά κείμενα εδώ. עברית וערבית: العربية.
日本語のテキストです。中文文本在这里。한국어 텍스트입니다.
Emoji time 😀🎉👍🏽 and symbols ✓ ★ → ∞ ≠ ½.
Tabs\there,  double  spaces,   triple   spaces,
newlines

and trailing spaces   
"""

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

SPECIAL_TOKENS = ["<|endoftext|>", "<|eot_id|>", "<|begin_of_text|>"]


def is_letter(c):
    return unicodedata.category(c).startswith("L")


def is_number(c):
    return unicodedata.category(c).startswith("N")


def is_space(c):
    # PCRE2's \s with Unicode properties: separators plus the ASCII and NEL controls.
    return unicodedata.category(c) in ("Zs", "Zl", "Zp") or c in "\t\n\x0b\x0c\r\x85"


def is_other(c):
    return not is_space(c) and not is_letter(c) and not is_number(c)


def run(text, i, predicate):
    """End of the longest run of characters from i that satisfy predicate."""
    while i < len(text) and predicate(text[i]):
        i += 1
    return i


def trailing_space_match(text, i):
    r"""\s+(?!\S) then \s+: a whitespace run, leaving its last space to the next word."""
    end = run(text, i, is_space)
    if end == i:
        return None
    if end == len(text) or end - i == 1:
        return end
    return end - 1


def gpt2_match(text, i):
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    for suffix in ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d"):
        if text.startswith(suffix, i):
            return i + len(suffix)
    start = i + 1 if text[i] == " " and i + 1 < len(text) else i
    for predicate in (is_letter, is_number, is_other):
        end = run(text, start, predicate)
        if end > start:
            return end
    return trailing_space_match(text, i)


def llama3_match(text, i):
    for suffix in ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d"):
        if text[i:i + len(suffix)].lower() == suffix:
            return i + len(suffix)
    # [^\r\n\p{L}\p{N}]?\p{L}+
    if text[i] not in "\r\n" and not is_letter(text[i]) and not is_number(text[i]):
        end = run(text, i + 1, is_letter)
        if end > i + 1:
            return end
    end = run(text, i, is_letter)
    if end > i:
        return end
    # \p{N}{1,3}
    end = run(text, i, is_number)
    if end > i:
        return min(end, i + 3)
    # ' ?[^\s\p{L}\p{N}]+[\r\n]*'
    start = i + 1 if text[i] == " " else i
    end = run(text, start, is_other)
    if end > start:
        return run(text, end, lambda c: c in "\r\n")
    # \s*[\r\n]+ ends after the last line break of the whitespace run
    end = run(text, i, is_space)
    breaks = [j for j in range(i, end) if text[j] in "\r\n"]
    if breaks:
        return breaks[-1] + 1
    return trailing_space_match(text, i)


def pre_tokenize(text, style):
    match = gpt2_match if style == "gpt2" else llama3_match
    words, i = [], 0
    while i < len(text):
        end = match(text, i)
        assert end is not None and end > i, (text, i)
        words.append(text[i:end])
        i = end
    return words


def bytes_to_unicode():
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) +
                 list(range(0xAE, 0x100)))
    mapping, shifted = {}, 256
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(shifted)
            shifted += 1
    return mapping


BYTE_CHAR = bytes_to_unicode()


def to_byte_chars(word):
    return "".join(BYTE_CHAR[b] for b in word.encode("utf-8"))


def learn(style, merge_count):
    counts = collections.Counter(to_byte_chars(w) for w in pre_tokenize(CORPUS, style))
    words = {word: list(word) for word in counts}
    vocab = [BYTE_CHAR[b] for b in range(256)]
    merges = []
    for _ in range(merge_count):
        pairs = collections.Counter()
        for word, symbols in words.items():
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] += counts[word]
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        vocab.append(best[0] + best[1])
        for word, symbols in words.items():
            merged, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            words[word] = merged
    return vocab, merges


def build(directory, style):
    vocab, merges = learn(style, 300)
    added = [{"id": len(vocab) + n, "content": content, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True}
             for n, content in enumerate(SPECIAL_TOKENS)]
    if style == "gpt2":
        pre_tokenizer = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                         "use_regex": True}
        merge_entries = [a + " " + b for a, b in merges]
    else:
        pre_tokenizer = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False}]}
        merge_entries = [[a, b] for a, b in merges]
    document = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None, "pre_tokenizer": pre_tokenizer,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                           "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": style == "llama3",
                  "vocab": {token: i for i, token in enumerate(vocab)},
                  "merges": merge_entries},
    }
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "tokenizer.json"), "w", encoding="utf-8") as out:
        json.dump(document, out, ensure_ascii=False, indent=1)


def encode(tokenizer_path, texts_path):
    with open(tokenizer_path, encoding="utf-8") as f:
        document = json.load(f)
    model = document["model"]
    vocab = model["vocab"]
    ranks = {}
    for rank, merge in enumerate(model["merges"]):
        pair = tuple(merge.split(" ", 1)) if isinstance(merge, str) else tuple(merge)
        ranks[pair] = rank
    style = "gpt2" if document["pre_tokenizer"]["type"] == "ByteLevel" else "llama3"
    ignore_merges = model.get("ignore_merges", False)
    specials = {t["content"]: t["id"] for t in document["added_tokens"]}

    def bpe(word):
        if ignore_merges and word in vocab:
            return [vocab[word]]
        symbols = list(word)
        while len(symbols) > 1:
            pairs = set(zip(symbols, symbols[1:]))
            best = min(pairs, key=lambda pair: ranks.get(pair, float("inf")))
            if best not in ranks:
                break
            merged, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        return [vocab[s] for s in symbols]

    def encode_text(text):
        ids, start, i = [], 0, 0
        while i < len(text):
            found = max((s for s in specials if text.startswith(s, i)), key=len, default=None)
            if found is None:
                i += 1
                continue
            for word in pre_tokenize(text[start:i], style):
                ids.extend(bpe(to_byte_chars(word)))
            ids.append(specials[found])
            i += len(found)
            start = i
        for word in pre_tokenize(text[start:], style):
            ids.extend(bpe(to_byte_chars(word)))
        return ids

    with open(texts_path, encoding="utf-8") as f:
        texts = json.load(f)
    json.dump([encode_text(text) for text in texts], sys.stdout)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build")
    build_parser.add_argument("directory")
    build_parser.add_argument("--style", choices=["gpt2", "llama3"], required=True)
    encode_parser = commands.add_parser("encode")
    encode_parser.add_argument("tokenizer")
    encode_parser.add_argument("texts")
    nfc_parser = commands.add_parser("nfc")
    nfc_parser.add_argument("texts")
    args = parser.parse_args()
    if args.command == "build":
        build(args.directory, args.style)
    elif args.command == "encode":
        encode(args.tokenizer, args.texts)
    else:
        with open(args.texts, encoding="utf-8") as f:
            texts = json.load(f)
        json.dump([unicodedata.normalize("NFC", text) for text in texts], sys.stdout)


if __name__ == "__main__":
    main()
