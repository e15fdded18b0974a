"""Evaluation tasks and training text for kvtools: generators, token counting and metrics.

Standard library only. Every generator is deterministic for a given --seed. The command line is
bench/kvtasks; the benchmark drivers call generate(), bake_input() and score() directly.

    kvtasks passkey   --tokens 2048 [--depths 10] [--per-depth 1]   classic passkey in filler
    kvtasks multikey  --tokens 2048 [--keys 4] [--count 50]          several needles, one asked
    kvtasks bios      --tokens 2048 [--documents 8] [--count 50]     biographies, one attribute asked
    kvtasks twohop    --tokens 2048 [--documents 8] [--count 50]     two facts in two documents
    kvtasks niah      --tokens 2048 [--documents 8] [--count 50]     needles in separate documents
    kvtasks train     --tokens 2048 --count N [--kinds K,...]        the demo model's training text
    kvtasks score     PREDICTIONS.jsonl [--gold TASKS.jsonl]         exact match and micro-F1

Task lines are {"id", "task", "documents": [...], "question", "answer", "context_tokens", ...}:
the full prompt is the documents joined as they are (each ends with a newline) followed by the
question, which ends with the start of the answer so that a base model continues it. That is the
shape kvtrain reads ({"documents", "question"}); `kvtasks bake-input` turns the documents into
kvbake's {"id", "text"} lines. Lengths are in tokens of the demo model's tokenizer
(models/demo/tokenizer.json), counted exactly with the same BPE; --chars-per-token estimates them
for another model instead.
"""
import argparse
import collections
import json
import os
import random
import re
import string
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_TOKENIZER = os.path.join(ROOT, "models", "demo", "tokenizer.json")
TASKS = ("passkey", "multikey", "bios", "twohop", "niah")
# Answer tokens to generate: enough for the longest answer and its newline.
PREDICT = {"passkey": 8, "multikey": 10, "bios": 6, "twohop": 24, "niah": 10}

# The demo tokenizer's pre-tokenizer, written for ASCII (every generated text is ASCII); the
# tokenizer.json carries the same pattern with \p{L} and \p{N}.
PRETOKEN_PATTERN = r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+"
PRETOKEN_RE = re.compile(PRETOKEN_PATTERN)

FIRST_NAMES = """Ada Alan Alice Amara Anton Aria Arlo Astrid Beatrix Bruno Caleb Camila Cecil Clara
Dario Delia Dmitri Edgar Elena Elias Elif Emil Enzo Esme Ezra Felix Fiona Freya Gideon Greta Hana
Hugo Ida Igor Imani Ines Ivan Jasper Jonas Juno Kai Karin Kenji Lara Leon Lina Luca Mabel Malik
Mara Marco Milo Mira Nadia Nico Nora Olga Omar Orla Oscar Otto Pablo Petra Quinn Rafael Rhea Rosa
Ruben Sami Selma Silas Sofia Stefan Tara Theo Tilda Tomas Ugo Una Vera Viktor Wanda Wren Xavier
Yara Yusuf Zara Zeno Boris Carmen Dora Emma Farid Gemma Hector Irene""".split()
LAST_NAMES = """Abbott Alvarez Baker Barros Becker Berg Brandt Castro Chen Costa Dalton Diaz Engel
Falk Farris Fischer Garcia Graves Hansen Hart Ibsen Jensen Kato Keller Klein Kowalski Lang Larsen
Lopez Lund Marsh Meyer Moreau Nagy Novak Okafor Olsen Ortega Park Patel Perez Quist Reyes Rossi
Sato Schmidt Silva Stone Tanaka Torres Ueda Varga Vogel Wagner Walsh Weber Young Zhou Ziegler Moss
Nash Pike Reed Shaw Todd Vance Wolfe""".split()
CITIES = """Paris Lisbon Oslo Vienna Prague Dublin Madrid Rome Berlin Warsaw Athens Cairo Lima Quito
Tokyo Seoul Delhi Hanoi Manila Sydney Perth Denver Boston Austin Dallas Toronto Ottawa Havana
Bogota Santiago Nairobi Accra Dakar Tunis Riga Tallinn Vilnius Sofia Zagreb Bern Geneva Munich
Hamburg Porto Seville Naples Milan Turin Lyon Nice Bergen Malmo Turku Krakow Gdansk""".split()
JOBS = """baker pilot nurse farmer painter teacher lawyer dentist chemist sailor carpenter plumber
tailor florist butcher jeweler architect surgeon librarian pharmacist potter weaver banker
engineer journalist photographer translator violinist gardener mechanic astronomer geologist
beekeeper blacksmith cartographer clockmaker""".split()
COLOURS = """red blue green yellow purple orange pink brown black white grey violet teal amber
crimson indigo silver golden""".split()
SYLLABLES = """zen tri vox cor lum nex tar bel mon dra kip sol ver qua fen rix mar tel zor bra
lin dex gal pho cyr ven""".split()

ADJECTIVES = """quiet small old bright tall green heavy warm cold wooden narrow busy lazy clever
gentle rusty silent sunny windy muddy""".split()
NOUNS = """river garden bridge window market teacher farmer lantern basket mountain harbor
village kitchen library forest meadow carriage tower orchard workshop""".split()
VERBS = """watched passed crossed followed painted cleaned visited noticed carried opened
repaired described""".split()
PLACES = """the old mill|the harbor|the town square|the hill|the station|the bakery|the river bank|
the school|the north road|the market hall""".replace("\n", "").split("|")

PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. "
                 "Find it and memorize it. I will quiz you about the important information there.")
PASSKEY_FILLER = ("The grass is green. The sky is blue. The sun is yellow. "
                  "Here we go. There and back again.")


class TokenCounter:
    """Counts tokens of the demo model's byte-level BPE (its merges, applied by rank)."""

    def __init__(self, tokenizer_path=None, chars_per_token=None):
        self.chars_per_token = chars_per_token
        self.ranks = {}
        self.cache = {}
        if chars_per_token:
            return
        path = tokenizer_path or DEFAULT_TOKENIZER
        if not os.path.exists(path):
            sys.exit(f"kvtasks: error: cannot open tokenizer '{path}' (use --tokenizer or "
                     "--chars-per-token)")
        with open(path, encoding="utf-8") as f:
            model = json.load(f)["model"]
        for rank, merge in enumerate(model["merges"]):
            pair = tuple(merge.split(" ")) if isinstance(merge, str) else tuple(merge)
            self.ranks[pair] = rank

    def _word(self, word):
        cached = self.cache.get(word)
        if cached is not None:
            return cached
        # Every generated text is ASCII and the byte-to-character map keeps printable ASCII
        # as itself; a space becomes 'Ġ' and a newline 'Ċ'.
        parts = [{" ": "\u0120", "\n": "\u010a"}.get(c, c) for c in word]
        while len(parts) > 1:
            best = None
            for i in range(len(parts) - 1):
                rank = self.ranks.get((parts[i], parts[i + 1]))
                if rank is not None and (best is None or rank < best[0]):
                    best = (rank, i)
            if best is None:
                break
            i = best[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        self.cache[word] = len(parts)
        return len(parts)

    def count(self, text):
        if self.chars_per_token:
            return max(1, round(len(text) / self.chars_per_token))
        return sum(self._word(piece) for piece in PRETOKEN_RE.findall(text))


def name_pool(rng, count):
    """`count` distinct full names."""
    names = set()
    while len(names) < count:
        names.add(f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}")
    return rng.sample(sorted(names), count)


def company(rng):
    return "".join(rng.choice(SYLLABLES) for _ in range(2)).capitalize() + " " + rng.choice(
        ["Labs", "Works", "Group", "Systems", "Foods", "Motors"])


def filler_sentence(rng):
    a, b = rng.sample(NOUNS, 2)
    forms = [
        f"The {rng.choice(ADJECTIVES)} {a} {rng.choice(VERBS)} the {b}.",
        f"A {rng.choice(ADJECTIVES)} {a} stood near {rng.choice(PLACES)}.",
        f"Nobody {rng.choice(VERBS)} the {a} at {rng.choice(PLACES)} that day.",
        f"The {a} was {rng.choice(ADJECTIVES)} and the {b} was {rng.choice(ADJECTIVES)}.",
        f"Someone {rng.choice(VERBS)} a {rng.choice(ADJECTIVES)} {a} by {rng.choice(PLACES)}.",
    ]
    return rng.choice(forms)


def digits(rng, count):
    return str(rng.randint(1, 9)) + "".join(rng.choice(string.digits) for _ in range(count - 1))


def fill_line(rng, counter, sentences, target_tokens, make_filler, depths=None):
    """A line of filler reaching about target_tokens, with `sentences` inserted at `depths`
    (fractions of the line); ends with a newline."""
    filler = []
    used = 0
    fixed = sum(counter.count(" " + s) for s in sentences) + 1
    while used + fixed < target_tokens:
        sentence = make_filler(rng)
        used += counter.count(" " + sentence)
        filler.append(sentence)
    if depths is None:
        depths = [rng.random() for _ in sentences]
    placed = sorted(zip(depths, range(len(sentences))))
    parts = list(filler)
    for depth, index in reversed(placed):
        parts.insert(round(depth * len(filler)), sentences[index])
    return " ".join(parts) + "\n"


def passkey_filler(_rng):
    return PASSKEY_FILLER


# Each generator returns a task dict; `context_tokens` is the length of the full prompt.

def make_passkey(rng, counter, tokens, depth):
    key = digits(rng, 5)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    question = "Question: What is the pass key? Answer: The pass key is"
    budget = tokens - counter.count(PASSKEY_INTRO + "\n") - counter.count(question) - 1
    body = fill_line(rng, counter, [needle], budget, passkey_filler, [depth])
    return {"task": "passkey", "documents": [PASSKEY_INTRO + "\n", body], "question": question,
            "answer": key, "depth": depth}


def needle_sentence(name, value):
    return f"The special magic number for {name} is {value}."


def make_multikey(rng, counter, tokens, keys, depth=None):
    names = name_pool(rng, keys)
    values = [digits(rng, 7) for _ in names]
    asked = rng.randrange(keys)
    depths = [rng.random() for _ in names]
    if depth is not None:
        depths[asked] = depth
    question = (f"Question: What is the special magic number for {names[asked]}? "
                f"Answer: The special magic number for {names[asked]} is")
    budget = tokens - counter.count(question) - 1
    body = fill_line(rng, counter, [needle_sentence(n, v) for n, v in zip(names, values)], budget,
                     filler_sentence, depths)
    return {"task": "multikey", "documents": [body], "question": question,
            "answer": values[asked], "depth": depths[asked], "keys": keys}


def bio_facts(rng, name):
    year = str(rng.randint(1900, 1999))
    city, job, colour = rng.choice(CITIES), rng.choice(JOBS), rng.choice(COLOURS)
    facts = {
        "year": (f"{name} was born in {year}.", f"In which year was {name} born?",
                 f"{name} was born in", year),
        "city": (f"{name} lives in {city}.", f"In which city does {name} live?",
                 f"{name} lives in", city),
        "job": (f"{name} works as a {job}.", f"What is the job of {name}?",
                f"{name} works as a", job),
        "colour": (f"{name} likes the colour {colour}.", f"Which colour does {name} like?",
                   f"{name} likes the colour", colour),
    }
    return facts


def split_budget(total, parts):
    base = total // parts
    return [base + (1 if i < total - base * parts else 0) for i in range(parts)]


def make_bios(rng, counter, tokens, documents):
    names = name_pool(rng, documents)
    bios = [bio_facts(rng, n) for n in names]
    asked = rng.randrange(documents)
    attribute = rng.choice(sorted(bios[asked]))
    _, question_text, prefix, answer = bios[asked][attribute]
    question = f"Question: {question_text} Answer: {prefix}"
    budgets = split_budget(tokens - counter.count(question) - 1, documents)
    docs = []
    for bio, budget in zip(bios, budgets):
        sentences = [bio[k][0] for k in ("year", "city", "job", "colour")]
        start = rng.random() * 0.5
        docs.append(fill_line(rng, counter, sentences, budget, filler_sentence,
                              [start + 0.1 * i for i in range(4)]))
    return {"task": "bios", "documents": docs, "question": question, "answer": answer,
            "attribute": attribute, "asked_document": asked}


def make_twohop(rng, counter, tokens, documents):
    people = name_pool(rng, max(1, documents // 2))
    companies = []
    while len(companies) < len(people):
        c = company(rng)
        if c not in companies:
            companies.append(c)
    cities = rng.sample(CITIES, len(companies))
    works = [f"{p} works for {c}." for p, c in zip(people, companies)]
    based = [f"{c} is based in {city}." for c, city in zip(companies, cities)]
    facts = works + based  # the two facts of a chain live in different documents
    while len(facts) < documents:
        facts.append(None)
    order = list(range(documents))
    rng.shuffle(order)
    asked = rng.randrange(len(people))
    question = (f"Question: In which city does {people[asked]} work? "
                f"Answer: {people[asked]} works for")
    answer = f"{companies[asked]}. {companies[asked]} is based in {cities[asked]}."
    budgets = split_budget(tokens - counter.count(question) - 1, documents)
    docs = []
    for slot, budget in zip(order, budgets):
        fact = facts[slot]
        docs.append(fill_line(rng, counter, [fact] if fact else [], budget, filler_sentence))
    return {"task": "twohop", "documents": docs, "question": question, "answer": answer}


def make_niah(rng, counter, tokens, documents):
    """Multi-document needle in a haystack: one needle per document, one asked."""
    names = name_pool(rng, documents)
    values = [digits(rng, 7) for _ in names]
    asked = rng.randrange(documents)
    question = (f"Question: What is the special magic number for {names[asked]}? "
                f"Answer: The special magic number for {names[asked]} is")
    budgets = split_budget(tokens - counter.count(question) - 1, documents)
    docs = [fill_line(rng, counter, [needle_sentence(n, v)], b, filler_sentence)
            for n, v, b in zip(names, values, budgets)]
    return {"task": "niah", "documents": docs, "question": question, "answer": values[asked],
            "asked_document": asked}


def finish(task, counter, index, tokens):
    task["id"] = f"{task['task']}-{tokens}-{index}"
    task["context_tokens"] = 1 + sum(counter.count(d) for d in task["documents"]) + counter.count(
        task["question"])
    ordered = {k: task[k] for k in ("id", "task", "context_tokens")}
    ordered.update({k: v for k, v in task.items() if k not in ordered})
    return ordered


# Training text for the demo model: one line per sequence, as segments [text, loss weight].
# Answers carry weight 1; the rest (filler, the facts themselves, whose random values cannot be
# predicted) carries a small weight so the model still learns the language of the documents.

CONTEXT_WEIGHT = 0.05


TRAINING_KINDS = {"passkey": 2, "multikey": 2, "bios": 3, "twohop": 3, "niah": 2, "mixed": 3,
                  "repeat": 3, "copy": 0, "recall": 0, "quiz": 0,
                  "bioquiz": 0, "hardbioquiz": 0}


def training_sample(rng, counter, tokens, kinds=None):
    """One training sequence of about `tokens` tokens, of a kind drawn from `kinds` (default: the
    task mixture; "copy" only when asked for, as the curriculum's first phase)."""
    if kinds is None:
        kinds = [k for k, w in TRAINING_KINDS.items() if w > 0]
    kind = rng.choices(kinds, [TRAINING_KINDS[k] or 1 for k in kinds])[0]
    if kind == "copy":
        return copy_sample(rng, counter, tokens)
    if kind == "recall":
        return recall_sample(rng, counter, tokens)
    if kind == "quiz":
        return quiz_sample(rng, counter, tokens)
    if kind == "bioquiz":
        return quiz_sample(rng, counter, tokens, biography_share=1.0, most_per_biography=4)
    if kind == "hardbioquiz":
        return quiz_sample(rng, counter, tokens, biography_share=1.0, most_per_biography=4,
                           confusable=True)
    if kind == "passkey":
        task = make_passkey(rng, counter, tokens, rng.random())
    elif kind == "multikey":
        task = make_multikey(rng, counter, tokens, rng.randint(1, 8))
    elif kind == "bios":
        task = make_bios(rng, counter, tokens, rng.randint(2, 16))
    elif kind == "twohop":
        task = make_twohop(rng, counter, tokens, 2 * rng.randint(1, 8))
    elif kind == "niah":
        task = make_niah(rng, counter, tokens, rng.randint(2, 16))
    elif kind == "mixed":
        return mixed_sample(rng, counter, tokens)
    else:
        return repeat_sample(rng, counter, tokens)
    segments = [[d, CONTEXT_WEIGHT] for d in task["documents"]]
    segments.append([task["question"], CONTEXT_WEIGHT])
    # The answer as the model should produce it, then a newline that ends generation.
    if task["task"] == "twohop":
        segments.append([" " + task["answer"] + "\n", 1.0])
    else:
        segments.append([" " + task["answer"] + ".\n", 1.0])
    return {"kind": kind, "segments": segments}


def repeat_sample(rng, counter, tokens):
    """A random list stated once and repeated later, every repeated token a target: the densest
    signal for the copying (induction) circuit that all retrieval here is built on."""
    pools = [FIRST_NAMES, LAST_NAMES, CITIES, COLOURS, JOBS]
    items = []
    for _ in range(rng.randint(4, 16)):
        roll = rng.random()
        if roll < 0.4:
            items.append(digits(rng, rng.randint(2, 7)))
        else:
            items.append(rng.choice(rng.choice(pools)))
    listing = ", ".join(items)
    before = rng.randint(0, max(0, tokens // 2))
    between = rng.randint(0, max(0, tokens - before - 2 * counter.count(listing) - 20))
    segments = []
    if before > 8:
        segments.append([fill_line(rng, counter, [], before, filler_sentence), CONTEXT_WEIGHT])
    segments.append([f"Remember this list: {listing}.\n", CONTEXT_WEIGHT])
    if between > 8:
        segments.append([fill_line(rng, counter, [], between, filler_sentence), CONTEXT_WEIGHT])
    segments.append(["Question: What was the list? Answer: The list was", CONTEXT_WEIGHT])
    segments.append([" " + listing + ".\n", 1.0])
    return {"kind": "repeat", "segments": segments}


def copy_sample(rng, counter, tokens):
    """Lists stated and restated at random distances, every restated token a target. Copying is
    what every retrieval task here is built on, and a small model trained only on the tasks,
    whose answers are a few tokens per sequence, takes thousands of steps to discover it (the
    induction-head phase change); this dense signal brings it within a few hundred."""
    pools = [FIRST_NAMES, LAST_NAMES, CITIES, COLOURS, JOBS]
    segments = []
    used = 0
    while used < tokens:
        items = [digits(rng, rng.randint(2, 7)) if rng.random() < 0.3
                 else rng.choice(rng.choice(pools)) for _ in range(rng.randint(4, 16))]
        listing = " ".join(items)
        stated = f"Remember: {listing}.\n"
        segments.append([stated, CONTEXT_WEIGHT])
        used += counter.count(stated)
        gap = rng.randint(0, max(0, (tokens - used) // 3))
        if gap > 8:
            text = fill_line(rng, counter, [], gap, filler_sentence)
            segments.append([text, CONTEXT_WEIGHT])
            used += counter.count(text)
        segments.append(["Again:", CONTEXT_WEIGHT])
        segments.append([" " + listing + ".\n", 1.0])
        used += counter.count(" " + listing + ".\n") + 2
    return {"kind": "copy", "segments": segments}


def recall_sample(rng, counter, tokens):
    """Associative recall: pairs stated once, then asked for by their key in another order,
    every answer a target. Finding a fact by its key, not by position, is the circuit behind
    multikey, biographies and two-hop; this teaches it densely, in short sequences."""
    pools = [CITIES, COLOURS, JOBS]
    segments = []
    used = 0
    while used < tokens:
        names = rng.sample(FIRST_NAMES, rng.randint(3, 8))
        values = [digits(rng, rng.randint(2, 5)) if rng.random() < 0.5
                  else rng.choice(rng.choice(pools)) for _ in names]
        facts = "Facts: " + ", ".join(f"{n} {v}" for n, v in zip(names, values)) + ".\n"
        segments.append([facts, CONTEXT_WEIGHT])
        used += counter.count(facts)
        order = list(range(len(names)))
        rng.shuffle(order)
        for i in order[:rng.randint(2, len(names))]:
            segments.append([f"{names[i]} is", CONTEXT_WEIGHT])
            segments.append([f" {values[i]}.\n", 1.0])
            used += counter.count(f"{names[i]} is {values[i]}.\n")
    return {"kind": "recall", "segments": segments}


def confusable_facts(rng):
    """A fact drawer for `hardbioquiz`: the people of one sequence often share the first letters
    of their cities, jobs and colours, and the decade of their birth years (each fact half the
    time), so that an answer's first token no longer tells whose it is: after phase 7 the model
    answered with the right first token and continued from another person's answer ("L" +
    "isbon" for Lyon, "19" + "8" for 1938)."""
    def bucket(words):
        by_letter = {}
        for word in words:
            by_letter.setdefault(word[0], []).append(word)
        shared = [group for _, group in sorted(by_letter.items()) if len(group) >= 2]
        return rng.choice(shared)
    cities, jobs, colours = bucket(CITIES), bucket(JOBS), bucket(COLOURS)
    decade = rng.randint(0, 9)

    def draw(name):
        # Each value from the shared group half of the time, so that values still vary.
        facts = bio_facts(rng, name)
        shared = {"year": str(1900 + 10 * decade + rng.randint(0, 9)), "city": rng.choice(cities),
                  "job": rng.choice(jobs), "colour": rng.choice(colours)}
        for attribute in ("year", "city", "job", "colour"):
            if rng.random() < 0.5:
                continue
            sentence, question, prefix, old_value = facts[attribute]
            value = shared[attribute]
            facts[attribute] = (value.join(sentence.rsplit(old_value, 1)), question, prefix, value)
        return facts
    return draw


def quiz_sample(rng, counter, tokens, biography_share=0.5, most_per_biography=2,
                confusable=False):
    """Documents holding biographies and magic numbers, then many questions about them, every
    answer a target. The single-question tasks give one answer of a few tokens per sequence of
    thousands; here a sequence gives a dozen, at every distance, and each question must be told
    apart from the others by the full name (the first names repeat, the sentence frames are the
    same in every document), which is where the model trained without it failed: a biography
    answer taken from another person, a 7-digit number copied with a wrong digit. `bioquiz`
    asks about biographies only, up to four questions each: years (all "19..") and jobs (after
    " a", the commonest token of the filler) were still taken from other people after `quiz`."""
    people = name_pool(rng, rng.randint(4, 24))
    facts_of = confusable_facts(rng) if confusable else lambda name: bio_facts(rng, name)
    questions = []  # (question, answer)
    documents = []  # the fact sentences of each document
    for name in people:
        if rng.random() < biography_share:
            facts = facts_of(name)
            documents.append([facts[k][0] for k in ("year", "city", "job", "colour")])
            for attribute in rng.sample(sorted(facts), rng.randint(1, most_per_biography)):
                _, question_text, prefix, answer = facts[attribute]
                questions.append((f"Question: {question_text} Answer: {prefix}", answer))
        else:
            value = digits(rng, 7)
            documents.append([needle_sentence(name, value)])
            questions.append((f"Question: What is the special magic number for {name}? Answer: "
                              f"The special magic number for {name} is", value))
    rng.shuffle(questions)
    questions = questions[:rng.randint(4, 12)]
    asked = "".join(f"{q} {a}.\n" for q, a in questions)
    budgets = split_budget(max(len(documents) * 8, tokens - counter.count(asked) - 1),
                           len(documents))
    segments = []
    for sentences, budget in zip(documents, budgets):
        start = rng.random() * 0.5
        text = fill_line(rng, counter, sentences, budget, filler_sentence,
                         [start + 0.1 * i for i in range(len(sentences))])
        segments.append([text, CONTEXT_WEIGHT])
    for question, answer in questions:
        segments.append([question, CONTEXT_WEIGHT])
        segments.append([f" {answer}.\n", 1.0])
    return {"kind": "quiz", "segments": segments}


def mixed_sample(rng, counter, tokens):
    """Facts of every kind among filler, with questions asked along the way: many answers per
    sequence, at every distance from their fact."""
    segments = []
    known = []  # (question prefix, answer) pairs whose fact has been stated
    used = 0
    while used < tokens:
        roll = rng.random()
        if roll < 0.45 or not known:
            name = f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
            if rng.random() < 0.5:
                value = digits(rng, rng.choice([5, 7]))
                fact = needle_sentence(name, value)
                known.append((f"Question: What is the special magic number for {name}? Answer: "
                              f"The special magic number for {name} is", value + "."))
            else:
                facts = bio_facts(rng, name)
                attribute = rng.choice(sorted(facts))
                sentence, question_text, prefix, answer = facts[attribute]
                fact = sentence
                known.append((f"Question: {question_text} Answer: {prefix}", answer + "."))
            text = fill_line(rng, counter, [fact], rng.randint(20, 200), filler_sentence)
            segments.append([text, CONTEXT_WEIGHT])
            used += counter.count(text)
        else:
            question, answer = known.pop(rng.randrange(len(known)))
            segments.append([question, CONTEXT_WEIGHT])
            segments.append([" " + answer + "\n", 1.0])
            used += counter.count(question) + counter.count(" " + answer + "\n")
    return {"kind": "mixed", "segments": segments}


# Metrics: SQuAD-style normalisation, exact match, and micro-F1 over bags of words with TP, FP and
# FN summed over all samples (as the KV Packet code computes it).

def normalize(text):
    text = text.split("\n")[0].lower()
    text = "".join(c if c not in string.punctuation else " " for c in text)
    return [w for w in text.split() if w not in ("a", "an", "the")]


def score(pairs):
    exact = 0
    tp = fp = fn = 0
    for prediction, gold in pairs:
        p, g = normalize(prediction), normalize(gold)
        exact += p == g
        common = collections.Counter(p) & collections.Counter(g)
        overlap = sum(common.values())
        tp += overlap
        fp += len(p) - overlap
        fn += len(g) - overlap
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"samples": len(pairs), "exact_match": exact / len(pairs) if pairs else 0.0,
            "micro_f1": f1}


def write_lines(items, output):
    out = sys.stdout if output in (None, "-") else open(output + ".tmp", "w", encoding="utf-8")
    for item in items:
        out.write(json.dumps(item, ensure_ascii=False) + "\n")
    if out is not sys.stdout:
        out.close()
        os.replace(output + ".tmp", output)


def generate(task, tokens=2048, count=50, seed=1, depths=10, per_depth=1, keys=4, documents=8,
             kinds=None, tokenizer=None, chars_per_token=None):
    """The samples `kvtasks TASK` writes with these options (the same defaults): a list for the
    tasks, an iterator of training sequences for "train"."""
    rng = random.Random(f"{task}-{tokens}-{seed}")
    counter = TokenCounter(tokenizer, chars_per_token)
    if task == "passkey":
        items, index = [], 0
        for d in range(depths):
            depth = d / max(1, depths - 1)
            for _ in range(per_depth):
                items.append(finish(make_passkey(rng, counter, tokens, depth), counter, index,
                                    tokens))
                index += 1
        return items
    if task == "train":
        unknown = sorted(set(kinds or []) - set(TRAINING_KINDS))
        if unknown:
            raise ValueError(f"unknown training kind {unknown[0]!r} (known: "
                             f"{', '.join(TRAINING_KINDS)})")
        return (training_sample(rng, counter, tokens, kinds) for _ in range(count))
    make = {"multikey": lambda: make_multikey(rng, counter, tokens, keys),
            "bios": lambda: make_bios(rng, counter, tokens, documents),
            "twohop": lambda: make_twohop(rng, counter, tokens, documents),
            "niah": lambda: make_niah(rng, counter, tokens, documents)}[task]
    return [finish(make(), counter, i, tokens) for i in range(count)]


def evaluation_samples(task, tokens, count, seed):
    """The samples eval-tasks and eval-compress score: `count` of the task (passkey: ten depths,
    count // 10 at each, at least one; multi-key: four keys; the others: eight documents)."""
    if task == "passkey":
        return generate(task, tokens, seed=seed, depths=10, per_depth=max(1, count // 10))
    return generate(task, tokens, count, seed, keys=4)


def bake_input(samples):
    """kvbake's input lines for the samples' documents: one packet per document, "ID/INDEX"."""
    return [{"id": f"{t['id']}/{i}", "text": d} for t in samples
            for i, d in enumerate(t["documents"])]


def store_documents(count, document_tokens=256, seed=1):
    """`count` NIAH haystack documents of about `document_tokens` tokens, one needle each (a
    distinct name and its number), as kvbake's {"id", "text"} lines: the documents of
    count / 8 eight-document NIAH samples, so that every prefix of a longer list is the shorter
    one. bench/bench-store and bench/bench-rag bake their stores from it."""
    per_sample = 8
    samples = generate("niah", document_tokens * per_sample, count=-(-count // per_sample),
                       seed=seed, documents=per_sample)
    return bake_input(samples)[:count]


NEEDLE_RE = re.compile(r"The special magic number for (.+?) is ([0-9]+)\.")


def needle(text):
    """(name, number) of the needle sentence in a NIAH document, or None."""
    found = NEEDLE_RE.search(text)
    return (found.group(1), found.group(2)) if found else None


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    parser = argparse.ArgumentParser(prog="kvtasks", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    sub = parser.add_subparsers(dest="command", required=True)
    generators = {}
    for name in TASKS + ("train",):
        p = sub.add_parser(name)
        p.add_argument("--tokens", type=int, default=2048, help="context length in tokens")
        p.add_argument("--count", type=int, default=50, help="number of samples")
        p.add_argument("--seed", type=int, default=1)
        p.add_argument("--tokenizer", help="demo tokenizer.json used to count tokens")
        p.add_argument("--chars-per-token", type=float, help="estimate lengths instead")
        p.add_argument("-o", "--output", help="output JSONL (default stdout)")
        generators[name] = p
    generators["passkey"].add_argument("--depths", type=int, default=10)
    generators["passkey"].add_argument("--per-depth", type=int, default=1)
    generators["multikey"].add_argument("--keys", type=int, default=4)
    for name in ("bios", "twohop", "niah"):
        generators[name].add_argument("--documents", type=int, default=8)
    generators["train"].add_argument(
        "--kinds", help="comma-separated kinds of sequence (default: the task mixture; also copy, "
        "recall, quiz, bioquiz, hardbioquiz)")
    p = sub.add_parser("score", help="exact match and micro-F1 of predictions")
    p.add_argument("predictions", help='JSONL with "prediction" and "answer" (or --gold)')
    p.add_argument("--gold", help="task JSONL whose answers match the predictions by id")
    p = sub.add_parser("bake-input", help="a task file's documents as kvbake input lines")
    p.add_argument("tasks")
    p.add_argument("-o", "--output")
    args = parser.parse_args()

    if args.command == "score":
        gold = {}
        if args.gold:
            gold = {t["id"]: t["answer"] for t in read_lines(args.gold)}
        rows = read_lines(args.predictions)
        pairs = [(r["prediction"], gold.get(r.get("id"), r.get("answer"))) for r in rows]
        print(json.dumps(score(pairs)))
        return
    if args.command == "bake-input":
        write_lines(bake_input(read_lines(args.tasks)), args.output)
        return

    options = {name: getattr(args, name) for name in ("depths", "per_depth", "keys", "documents")
               if hasattr(args, name)}
    kinds = args.kinds.split(",") if getattr(args, "kinds", None) else None
    try:
        items = generate(args.command, args.tokens, args.count, args.seed, kinds=kinds,
                         tokenizer=args.tokenizer, chars_per_token=args.chars_per_token,
                         **options)
    except ValueError as error:
        parser.error(str(error))
    write_lines(items, args.output)


if __name__ == "__main__":
    main()
