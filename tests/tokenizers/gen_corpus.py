#!/usr/bin/python3
"""The tokenizer conformance corpus: a few thousand strings, one JSON object a line ({"text": ...}).

Deterministic: the same lines on every run and every Python 3 (its own generator, splitmix64, not
the random module). Categories: plain prose in several scripts, code, numbers, runs of spaces,
newlines and tabs, CJK, emoji and combining marks, code points at UTF-8's length boundaries and
text that looks like bytes or byte tokens, special tokens written in text, and random mixtures of
all of these.

Usage: gen_corpus.py > corpus.jsonl
"""

import json
import sys

MASK = (1 << 64) - 1


class Rng:
    """splitmix64: a fixed sequence for a fixed seed, whatever the Python version."""

    def __init__(self, seed):
        self.state = seed & MASK

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    def below(self, n):
        return self.next() % n

    def pick(self, items):
        return items[self.below(len(items))]

    def chance(self, percent):
        return self.below(100) < percent


PROSE = [
    "The quick brown fox jumps over the lazy dog.",
    "It's the dog's day; they're sure we've seen what I'm saying, you'll know we'd agree.",
    "IT'S THE DOG'S DAY; THEY'RE SURE WE'VE SEEN, I'M, YOU'LL, WE'D, DON'T",
    "It'S mixed 'Re 'vE 'Ll 'D case and 's't're've'm'll'd ''s",
    "Once upon a time, in a land far, far away, there lived a little robot named Pip.",
    "\"Well,\" she said, \"I suppose we'll have to try again tomorrow.\"",
    "Mr. and Mrs. Dursley, of number four, Privet Drive, were proud to say that they were "
    "perfectly normal, thank you very much.",
    "Call me Ishmael. Some years ago - never mind how long precisely - having little or no money "
    "in my purse, and nothing particular to interest me on shore...",
    "The attention mechanism computes a weighted sum of values, where the weights come from a "
    "softmax over query-key dot products.",
    "Hello world",
    "hello World HELLO wORLD",
    "e.g. i.e. etc. vs. Dr. St. U.S.A. a.m. p.m.",
    "Wait... what?! No way!!! (Really?) [Yes.] {Maybe} <Never>",
    "Café au lait, naïve résumé, crème brûlée, façade, Ångström, Straße, Ærøskøbing.",
    "Der schnelle braune Fuchs springt über den faulen Hund. Größenwahn, Übermaß, Ärger.",
    "Le cœur a ses raisons que la raison ne connaît point. L'été dernier, j'ai vu Noël.",
    "¿Dónde está la biblioteca? ¡Qué día tan bonito! El niño comió piña.",
    "Привет, как дела? Всё хорошо. Съешь же ещё этих мягких французских булок.",
    "Ελληνικά κείμενα: Ξεσκεπάζω την ψυχοφθόρα βδελυγμία.",
    "עברית: דג סקרן שט בים מאוכזב ולפתע מצא חברה.",
    "العربية: نص حكيم له سر قاطع وذو شأن عظيم مكتوب على ثوب أخضر.",
    "हिन्दी: ऋषियों को सताने वाले दुष्ट राक्षसों के राजा रावण का सर्वनाश करने वाले विष्णुवतार भगवान श्रीराम।",
    "ภาษาไทย: เป็นมนุษย์สุดประเสริฐเลิศคุณค่า",
    "Tiếng Việt: Tôi có thể ăn thủy tinh mà không hại gì.",
    "Türkçe: Pijamalı hasta yağız şoföre çabucak güvendi. İstanbul, ıspanak.",
    "Polski: Pchnąć w tę łódź jeża lub ośm skrzyń fig. Zażółć gęślą jaźń.",
    "ქართული ენა: ჭყინტი ქოხი; Հայերեն: Բարեւ; አማርኛ: ሰላም",
    "Tamil: யாமறிந்த மொழிகளிலே தமிழ்மொழி போல் இனிதாவது எங்கும் காணோம்",
]

CJK = [
    "日本語のテキストです。中文文本在这里。한국어 텍스트입니다.",
    "我能吞下玻璃而不伤身体。",
    "私はガラスを食べられます。それは私を傷つけません。",
    "나는 유리를 먹을 수 있어요. 그래도 아프지 않아요",
    "東京都渋谷区神南1-2-3、ｶﾀｶﾅ半角ｶﾅ、ＡＢＣ全角ａｂｃ１２３",
    "繁體中文：臺灣的資訊科技產業蓬勃發展。",
    "《红楼梦》是中国古典四大名著之一，作者曹雪芹。",
    "「こんにちは」と彼は言った。『はい』……",
    "𠀀𠀁𠀂 𪜀 𫝀 𬺰 𰀀 (CJK extensions B to G)",
    "々〆〇ー・ヽヾゝゞ〻",
    "ㄅㄆㄇㄈ 注音符號 ㆠ ㆡ",
    "一二三四五六七八九十百千万億",
    "Mixed 中文 and English 混合 text テキスト 123 한글",
]

EMOJI = [
    "Emoji time 😀🎉👍🏽 and family 👨‍👩‍👧 and flags 🇫🇷🇯🇵.",
    "❤️ ❤ ☺️ ☺ ✌🏿 👋🏻👋🏼👋🏽👋🏾👋🏿",
    "🏳️‍🌈 🏴‍☠️ 🧑‍💻 👩🏽‍🚀 🫠 🫶🏻",
    "keycaps: 1️⃣ 2️⃣ #️⃣ *️⃣ 🔟",
    "🏴󠁧󠁢󠁳󠁣󠁴󠁿 (tag sequence) 🇺🇳 🇪🇺",
    "😀😃😄😁😆😅😂🤣🥲☺️😊😇🙂🙃😉😌😍🥰😘😗😙😚😋😛😝😜🤪🤨🧐🤓😎🥸🤩🥳",
    "ok👍",
    "👍ok",
    "a😀b😀c",
    "🙂 🙂  🙂   🙂",
]

COMBINING = [
    "e\u0301 combining acute, a\u030a ring, n\u0303 tilde, o\u0308 diaeresis",
    "e\u0301\u0302\u0303\u0304\u0305 stacked",
    "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a\u032f"
    "\u031e\u0320\u034da\u0357\u0369\u0301\u0314\u035b\u0307\u0361\u0342\u0314\u0311l\u035b"
    "\u0368\u0346\u0341g\u0309\u0350o\u0360\u036c",
    "caf\u00e9 vs cafe\u0301",
    "\u212b (angstrom sign) vs \u00c5 vs A\u030a",
    "\u1100\u1161\u11a8 (decomposed hangul) vs \uac01",
    "\u0915\u093c\u093f \u0926\u0947\u0935\u0928\u093e\u0917\u0930\u0940 with nukta",
    "\u0301 a leading combining mark",
    "a\u0300\u0301\u0302\u0303\u0304\u0305\u0306\u0307\u0308\u0309\u030a\u030b\u030c",
    "\u1e9b\u0323 (long s with dots)",
    "\u00c7\u0301 vs C\u0327\u0301 vs \u1e08",
    "\u0041\u030a\u0301 \u01fa",
    "q\u0307\u0323 q\u0323\u0307",
    "\u05e9\u05c1\u05bc \u05e9\u05bc\u05c1 (hebrew points)",
    "\u0627\u064e\u0644\u0652\u0639\u064e\u0631\u064e\u0628\u0650\u064a\u064e\u0651\u0629\u064f (harakat)",
    "\u0e01\u0e34\u0e4a thai marks, \u0f40\u0f7a tibetan",
    "\u2126 ohm vs \u03a9 omega, \u212a kelvin vs K, \ufb01 ligature, \u2460 circled",
    "\uff21\uff22\uff23 fullwidth, \u00bd \u00b2 \u2167",
]

CODE = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    "#include <stdio.h>\nint main(void) {\n  printf(\"Hello, %s!\\n\", \"world\");\n  return 0;\n}",
    "const x = await fetch(`/api/${id}?q=${encodeURIComponent(q)}`);",
    "SELECT id, name FROM users WHERE age >= 21 AND name LIKE '%son' ORDER BY id DESC;",
    "{\"key\": [1, 2.5, -3e10, true, null], \"nested\": {\"a\": \"b\"}}",
    "if [ -f \"$HOME/.bashrc\" ]; then . \"$HOME/.bashrc\"; fi  # comment",
    "x = y*2 + f(z)[3]; // done\ny += 1;   /* block */",
    "<html>\n  <body class=\"main\">\n    <p>Hi &amp; bye</p>\n  </body>\n</html>",
    "    indented four\n        indented eight\n\t\ttabbed twice\n",
    "fn main() -> Result<(), Box<dyn Error>> {\n    let v: Vec<u8> = vec![0x00, 0xFF];\n    Ok(())\n}",
    "class Foo(Bar):\n    \"\"\"Docstring.\"\"\"\n\n    def __init__(self, *args, **kwargs):\n        super().__init__(*args, **kwargs)\n",
    "a==b!=c<=d>=e&&f||g->h::i<<j>>k",
    "x+=1;y-=2;z*=3;w/=4;v%=5;u**=6;",
    "path C:\\Users\\fox\\Documents\\file.txt and /usr/local/bin/kvserve-once",
    "Email: someone@example.com, URL: https://example.org/a/b?c=d&e=f#g",
    "$ ls -la | grep '^d' | awk '{print $9}'",
    "    return    x   ;   ",
    "```python\nprint('hi')\n```",
    "# Title\n\n- item 1\n- item 2\n  - nested\n\n1. one\n2. two\n",
    "@decorator\ndef f(): pass\n\n\n\nclass C: ...",
    "\tif (a) {\n\t\treturn b;\n\t}\n",
    "let s = 'it''s'; let t = \"she said \\\"hi\\\"\";",
    "#define MAX(a, b) ((a) > (b) ? (a) : (b))",
    "0x1F 0b1010 0o777 1_000_000 3.14f 1e-9 .5 5.",
]

NUMBERS = [
    "In 2023, 1,234,567 people paid $89.99 each -- 110 million... or 3.14159?",
    "1234567890 12 123 1234 0001 9,999,999",
    "Call 555-0123 or +1 (800) 555-0199 ext. 42",
    "2024-02-29T23:59:59.999Z, 12/31/1999, 31.12.1999",
    "3.14159265358979323846264338327950288419716939937510",
    "-0.0 +1 -1 1e10 1E-10 6.022e23 0.000001",
    "99 bottles, 100%, 50/50, 3/4, 2^10=1024, 7!=5040",
    "١٢٣٤٥ ٠ arabic-indic, ۱۲۳ persian, १२३ devanagari, ๑๒๓ thai, ১২৩ bengali",
    "１２３４５ fullwidth, ①②③ circled, Ⅻ roman, ½ ¾ ² ³",
    "123456789012345678901234567890123456789012345678901234567890",
    "v1.2.3-rc.4+build.5 and 192.168.0.1:8080",
    "1st 2nd 3rd 4th 21st 101st",
    "$1,000.00 €2.50 £3 ¥400 ₹50 ₿0.001",
    "0",
    "00",
    "000",
    "0000",
    "1 22 333 4444 55555 666666",
]

SPECIALS = [
    "<s>",
    "</s>",
    "<unk>",
    "<pad>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_special_token_5|>",
    "<|end|>",
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
    "<|placeholder1|>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "<|startoftranscript|>",
    "<|notimestamps|>",
    "<|en|>",
    "<|0.00|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "<|fim_prefix|>",
    "<|vision_start|>",
]

SPECIAL_TEMPLATES = [
    "{t}",
    "{t}{t}",
    "{t} {t}",
    "a{t}b",
    "a {t} b",
    "a  {t}  b",
    "a\n{t}\nb",
    "a\t{t}\tb",
    "{t}hello",
    "{t} hello",
    "hello{t}",
    "hello {t}",
    "hello {t} ",
    " {t}",
    "  {t}  ",
    "\n\n{t}\n\n",
    "word{t}word",
    "<{t}>",
    "{t}{t}{t}",
    "{t}\u00e9",
    "\u4e2d{t}\u6587",
    "\U0001f600{t}\U0001f600",
]

CHAT = [
    "<s>[INST] What is the capital of France? [/INST] Paris.</s>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "<|user|>\nHow are you?<|end|>\n<|assistant|>\nFine, thanks.<|end|>\n<|endoftext|>",
    "<|user|> spaced <|end|> out <|assistant|>   answer   <|end|>",
    "<|eot_id| partial <|eot_id|",
    "<|im_end <|im_end|> <|im_end|",
    "<s<s>> </s</s>>",
    "<S> </S> <UNK> <|ENDOFTEXT|>",
    "<|eot_id|><|begin_of_text|>x<|endoftext|> y",
    "text</s>",
    "text </s> text",
    "</s>\n\n</s>",
    "<unk><unk> <unk>",
    "[INST][/INST] [INST] x [/INST]",
]

BOUNDARIES = [
    "\u007f DEL and \u0080 \u0081 \u009f C1 controls",
    "\u07ff \u0800 two/three-byte boundary",
    "\uffff \U00010000 three/four-byte boundary",
    "\U0010ffff last code point",
    "\ud7ff \ue000 around the surrogates",
    "\ufffd replacement character \ufffd\ufffd",
    "\ufffe \uffff noncharacters \U0001fffe",
    "\ue000\uf8ff private use \U000f0000 \U00100000",
    "\u00c3\u00a9 mojibake of \u00e9, \u00e2\u20ac\u2122 of \u2019",
    "<0xE2><0x96><0x81> byte tokens written as text",
    "<0x00> <0xFF> <0x41>",
    "\\xe2\\x96\\x81 escapes written as text",
    "\u0120 \u010a \u0109 \u0100 \u0101 byte-level alphabet letters",
    "\u0120the \u0120\u0120 \u010a\u010a",
    "\u2581 metaspace \u2581\u2581 \u2581word",
    "\u2581",
    "word\u2581word",
    "\x00",
    "a\x00b",
    "\x01\x02\x03\x1b[31mred\x1b[0m",
    "\x07\x08\x0b\x0c\x0e\x0f",
    "\r",
    "\r\r\n\n\r",
    "\u200b zero\u200bwidth \u200c\u200d \u2060 \ufeff BOM",
    "\u00ad soft hyphen",
    "\u2028 line sep \u2029 para sep \u0085 NEL",
    "non\u00a0breaking\u202fspaces\u3000ideographic\u2009thin\u200ahair\u2007figure",
    "\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006",
    "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e bidi controls",
    "\U0001d400\U0001d401 math bold, \U0001d7d8 double-struck",
    "\U0001f3fb alone, \u200d alone, \ufe0f alone",
    "\u0300",
    "\U00010348 gothic \U0001f600",
    "\u00ff\u0100\u017f\u0180",
    "\u00e0\u00e1\u00e2\u00e3\u00e4\u00e5",
]

# Characters the random mixtures draw from, grouped so that each string has a flavour.
POOLS = {
    "ascii": [chr(c) for c in range(0x20, 0x7F)],
    "letters": list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"),
    "digits": list("0123456789"),
    "space": [" ", " ", " ", "\t", "\n", "\r\n", "\n\n", "  ", "\u00a0", "\u3000"],
    "punct": list(".,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`"),
    "latin": list("àáâãäåæçèéêëìíîïñòóôõöøùúûüýÿßœŒĳŁłŠšŽž"),
    "cyrillic": list("абвгдеёжзийклмнопрстуфхцчшщъыьэюяАБВГД"),
    "cjk": list("的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会"
                "あいうえおかきくけこアイウエオカキクケコ한국어텍스트"),
    "emoji": ["😀", "🎉", "👍", "👍🏽", "❤️", "🇫🇷", "👨‍👩‍👧", "🤖", "🔥", "✨", "🧑‍💻"],
    "combining": ["\u0301", "\u0300", "\u0308", "\u0327", "\u0303", "\u030a", "\u0323"],
    "rare": ["\U00020000", "\U0002a700", "\U0001d400", "\U00010348", "\ufffd", "\u2581", "\u0120",
             "\u010a", "\ue000", "\U0010fffd", "\u200b", "\u00ad", "\x00", "\x7f", "\u0085"],
}

WORDS = ("the of and to in is was that for it with as his on be at by had are but from or have an "
         "they which one you were all we her she there would their will when who him been has more "
         "if no out do so can what up said about other into than its time only could new them man "
         "some these then two first may any like now my such make over our even most me state after "
         "also made many did must before back see through way where get much go well your know "
         "should down work year because come people just say each those take day good how long "
         "Mr own too little use US very great still men here life both between old under last never "
         "place same another think house while high right might came off find states since used "
         "give against three himself look few general hand school part small American home during "
         "number again Mrs around thought went without however Government don't does got public "
         "United point end become head once course fact upon need system set every war put form "
         "water took program present government thing told possible group large until always city "
         "didn't order away called want eyes something unit fire").split()


def prose_paragraph(rng):
    sentences = []
    for _ in range(1 + rng.below(4)):
        words = [rng.pick(WORDS) for _ in range(3 + rng.below(14))]
        words[0] = words[0][:1].upper() + words[0][1:]
        sentence = " ".join(words)
        if rng.chance(20):
            sentence = sentence.replace(" ", ", ", 1)
        sentences.append(sentence + rng.pick([".", ".", ".", "?", "!", "...", ":", ";"]))
    return rng.pick([" ", " ", "  ", "\n", "\n\n"]).join(sentences)


def whitespace_strings():
    out = []
    for n in list(range(1, 18)) + [24, 31, 32, 33, 40, 64, 100]:
        out.append(" " * n)
        out.append("a" + " " * n + "b")
        out.append(" " * n + "word")
        out.append("word" + " " * n)
        out.append("\n" * n)
        out.append("x" + "\n" * n + "y")
        out.append("\t" * n)
        out.append("x" + "\t" * n + "y")
    for piece in ["\r\n", " \n", "\n ", " \t", "\t ", "\n\t", "\u00a0", "\u3000", "\r"]:
        for n in (1, 2, 3, 5, 8):
            out.append(piece * n)
            out.append("a" + piece * n + "b")
            out.append("end." + piece * n)
    out += [
        "",
        "a",
        " a",
        "  a",
        "a ",
        "a  ",
        " a ",
        "\na",
        "a\n",
        "\n a",
        "a \n",
        "a\n \nb",
        "a \n \n b",
        "a\n\n\n\nb   \n\n  c",
        "line one\nline two\r\nline three\rline four",
        "  two leading spaces",
        "trailing spaces   ",
        "tabs\tand\t\ttabs \t mixed",
        "mixed \t \n \r\n \u00a0 \u3000 end",
        "\n\n\nleading newlines",
        "a  b   c    d     e      f",
        "    ",
        " \n ",
        "\t\n",
        "  .  ,  !  ",
        " 's 't 're",
        " ' s",
    ]
    return out


def special_strings():
    out = []
    for token in SPECIALS:
        for template in SPECIAL_TEMPLATES:
            out.append(template.format(t=token))
    return out + CHAT


def boundary_strings(rng):
    out = list(BOUNDARIES)
    # Single code points around every UTF-8 length boundary and in awkward places.
    for cp in [0x1, 0x9, 0xA, 0xD, 0x1F, 0x20, 0x7E, 0x7F, 0x80, 0x9F, 0xA0, 0xAD, 0xFF, 0x100,
               0x17F, 0x2FF, 0x300, 0x36F, 0x7FF, 0x800, 0xFFF, 0x1000, 0x2581, 0x3000, 0xD7FF,
               0xE000, 0xFDD0, 0xFEFF, 0xFFFC, 0xFFFD, 0xFFFE, 0xFFFF, 0x10000, 0x1F600,
               0x20000, 0xE0001, 0xF0000, 0x10FFFF]:
        out.append(chr(cp))
        out.append("a" + chr(cp) + "b")
        out.append(" " + chr(cp) + " ")
    # Rare characters that byte-level tokenizers spell with byte tokens, next to common ones.
    rare = POOLS["rare"] + ["\U0002b740", "\U0001f9ff", "\u0f00", "\u1d00", "\u2c00", "\ua000"]
    for _ in range(60):
        text = ""
        for _ in range(1 + rng.below(6)):
            text += rng.pick(rare) if rng.chance(60) else rng.pick(POOLS["letters"] + [" "])
        out.append(text)
    return out


def random_mixture(rng):
    names = sorted(POOLS)
    chosen = [rng.pick(names) for _ in range(1 + rng.below(3))]
    length = 1 + rng.below(rng.pick([8, 24, 80]))
    text = ""
    for _ in range(length):
        pool = POOLS[rng.pick(chosen)] if rng.chance(85) else POOLS[rng.pick(names)]
        text += rng.pick(pool)
    return text


def word_salad(rng):
    parts = []
    for _ in range(1 + rng.below(12)):
        kind = rng.below(10)
        if kind < 4:
            parts.append(rng.pick(WORDS))
        elif kind == 4:
            parts.append(str(rng.below(10 ** rng.below(12))))
        elif kind == 5:
            parts.append(rng.pick(SPECIALS))
        elif kind == 6:
            parts.append(rng.pick(POOLS["emoji"]))
        elif kind == 7:
            parts.append("".join(rng.pick(POOLS["cjk"]) for _ in range(1 + rng.below(5))))
        elif kind == 8:
            parts.append(rng.pick(WORDS) + rng.pick(POOLS["combining"]))
        else:
            parts.append(rng.pick(POOLS["punct"]) * (1 + rng.below(3)))
    separators = [" ", " ", " ", "", "  ", "\n", "\t", " \n"]
    return "".join(part + rng.pick(separators) for part in parts)


def corpus():
    rng = Rng(20260512)
    items = []

    def add(category, texts):
        items.extend((category, text) for text in texts)

    add("prose", PROSE)
    add("prose", [prose_paragraph(rng) for _ in range(500)])
    add("code", CODE)
    add("code", [c.replace("    ", "\t") for c in CODE] + [c.replace("\n", "\r\n") for c in CODE])
    add("numbers", NUMBERS)
    add("numbers", [str(rng.below(10 ** (1 + rng.below(20)))) for _ in range(150)])
    add("numbers", ["%d.%0*d" % (rng.below(100000), 1 + rng.below(6), rng.below(10 ** 6))
                    for _ in range(50)])
    add("numbers", ["%s%d%s" % (rng.pick(["", "$", "-", "+", "#", "(", "x"]),
                                rng.below(1 << 31), rng.pick(["", "%", "th", "k", ")", ".", "s"]))
                    for _ in range(50)])
    add("whitespace", whitespace_strings())
    add("cjk", CJK)
    add("cjk", ["".join(rng.pick(POOLS["cjk"]) for _ in range(1 + rng.below(30)))
                for _ in range(120)])
    add("emoji", EMOJI)
    add("emoji", ["".join(rng.pick(POOLS["emoji"] + [" ", "a"]) for _ in range(1 + rng.below(10)))
                  for _ in range(100)])
    add("combining", COMBINING)
    add("combining", [rng.pick(WORDS) + "".join(rng.pick(POOLS["combining"])
                                                for _ in range(1 + rng.below(3)))
                      for _ in range(100)])
    add("boundaries", boundary_strings(rng))
    add("special", special_strings())
    add("mixed", [word_salad(rng) for _ in range(500)])
    add("random", [random_mixture(rng) for _ in range(700)])
    # Longer documents: several kinds of text run together.
    add("long", ["\n\n".join(rng.pick(PROSE + CODE + CJK + EMOJI + NUMBERS + COMBINING)
                             for _ in range(2 + rng.below(10))) for _ in range(60)])
    return items


def main():
    seen = set()
    out = sys.stdout
    for category, text in corpus():
        if text in seen:
            continue
        seen.add(text)
        out.write(json.dumps({"category": category, "text": text}, ensure_ascii=True) + "\n")


if __name__ == "__main__":
    main()
