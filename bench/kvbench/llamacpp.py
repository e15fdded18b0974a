"""llama.cpp beside kvserve-once: the same context restored from llama.cpp's own session file
and the same question answered by llama-cli (bench-ttft --llamacpp).

llama.cpp is built outside the repository (never committed here); this module needs its
llama-cli and llama-tokenize, of a version whose session files are version 9 (c392e50,
February 2025, is the one measured). The model is written to GGUF by tests/tools/to_gguf.py
(bf16, as the safetensors hold it). Computing a long context's state with llama.cpp takes what
computing it takes (~70 min of 2 cores at 32k for the 1B shape), so the state of each length is
the state llama-cli saved after a 256-token prompt with its cells repeated
(bench/llamacpp-tile-state): a file of the length's size and llama.cpp's layout, read and
copied as any other; its answer means nothing, as the synthetic packets' answers mean nothing.
"""
import os
import pathlib
import re
import subprocess
import tempfile
import time

from . import ROOT, tools

SEED_TOKENS = 256
# Cache cells llama-cli gets beyond the context and the tokens it answers with: the question's.
QUESTION_CELLS = 64
# llama-cli --log-prefix --log-timestamps: "M.SS.mmm.uuu L message" (minutes, seconds, ...).
STAMP = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) \w (.*)$")


def add_arguments(parser):
    """--llamacpp and --llamacpp-flash-attn, as the drivers that run llama.cpp take them."""
    parser.add_argument("--llamacpp", help="llama.cpp's build folder (llama-cli, llama-tokenize): "
                                           "llama.cpp's rows beside the builds' full attention")
    parser.add_argument("--llamacpp-flash-attn", action="store_true", help="llama-cli -fa")


def from_arguments(args, work, model_folder):
    """The LlamaCpp that --llamacpp names, or None. `work` holds the packets' document
    (doc.txt), whose text the contexts repeat."""
    if not args.llamacpp:
        return None
    return LlamaCpp(args.llamacpp, work, model_folder, args.threads, args.llamacpp_flash_attn)


class LlamaCpp:
    def __init__(self, folder, work, model_folder, threads, flash_attn):
        folder = pathlib.Path(folder)
        self.cli, self.tokenize = folder / "llama-cli", folder / "llama-tokenize"
        for program in (self.cli, self.tokenize):
            if not os.access(program, os.X_OK):
                tools.fail(f"--llamacpp {folder}: no {program.name} there (build llama.cpp's "
                           "llama-cli and llama-tokenize targets)")
        self.document = (pathlib.Path(work) / "doc.txt").read_text()
        self.work = pathlib.Path(work) / "llamacpp"
        self.work.mkdir(parents=True, exist_ok=True)
        self.threads = threads
        self.flash = ["-fa"] if flash_attn else []
        self.suffix = "-fa" if flash_attn else ""
        self.gguf = self.work / "random-1b.gguf"
        # Written under another name, then renamed: an interrupted run leaves no half file
        # that later runs would take for whole.
        if not self.gguf.exists():
            partial = self.gguf.with_suffix(".gguf.partial")
            tools.run(["/usr/bin/python3", ROOT / "tests" / "tools" / "to_gguf.py", model_folder,
                       partial, "--type", "bf16"])
            os.replace(partial, self.gguf)
        self.seed = self.work / f"seed{self.suffix}.bin"
        if not self.seed.exists():
            text = self.work / "seed.txt"
            text.write_text(self.context_text(SEED_TOKENS))
            partial = self.seed.with_suffix(".bin.partial")
            self.cli_run(text, partial, SEED_TOKENS + 1, keep_state=False)
            os.replace(partial, self.seed)

    def context_text(self, tokens):
        """The packets' document repeated and cut to `tokens` characters: one token each for the
        1B shape's byte-level tokenizer (checked in prepare)."""
        return (self.document * (tokens // len(self.document) + 1))[:tokens]

    def prepare(self, length, question):
        """The prompt file (context and question) and the session file of the context."""
        context = self.work / f"context-{length}.txt"
        context.write_text(self.context_text(length))
        ids = subprocess.run([str(self.tokenize), "-m", str(self.gguf), "-f", str(context),
                              "--ids", "--log-disable"], capture_output=True, text=True, check=True)
        tokens = [t for t in ids.stdout.strip().splitlines()[-1].strip("[] ").split(", ") if t]
        if len(tokens) != length + 1:
            tools.fail(f"llama-tokenize made {len(tokens)} tokens of {length} characters "
                       "(expected one per character and BOS): --llamacpp needs the 1B shape's "
                       "byte-level tokenizer")
        token_file = self.work / f"context-{length}.tokens"
        token_file.write_text("\n".join(tokens) + "\n")
        state = self.work / f"state-{length}{self.suffix}.bin"
        if not state.exists():
            tools.run([ROOT / "bench" / "llamacpp-tile-state", self.seed, token_file, state])
        prompt = self.work / f"prompt-{length}.txt"
        prompt.write_text(context.read_text() + question)
        return prompt, state

    def cli_run(self, prompt, state, cells, keep_state=True, tokens=1):
        """llama-cli answering `prompt` with `tokens` tokens from `state` (read only), or saving
        the state of `prompt` (keep_state False). Returns its log, wall and CPU seconds."""
        context_size = (cells + tokens + QUESTION_CELLS + 255) // 256 * 256
        command = [str(self.cli), "-m", str(self.gguf), "-f", str(prompt), "-n", str(tokens),
                   "--ignore-eos",
                   "--prompt-cache", str(state), "-no-cnv", "-t", str(self.threads),
                   "-c", str(context_size), "--temp", "0", "--log-prefix", "--log-timestamps",
                   "--no-display-prompt", *self.flash] + (["--prompt-cache-ro"] if keep_state else [])
        with tempfile.TemporaryFile() as log:
            started = time.perf_counter()
            process = subprocess.Popen(command, stdout=log, stderr=log)
            _, status, usage = os.wait4(process.pid, 0)
            wall = time.perf_counter() - started
            log.seek(0)
            text = log.read().decode(errors="replace")
        if os.waitstatus_to_exitcode(status) != 0:
            tools.fail(f"llama-cli failed (exit {os.waitstatus_to_exitcode(status)}): "
                       + " | ".join(text.strip().splitlines()[-3:]))
        return text, wall, usage.ru_utime + usage.ru_stime

    def serve(self, prompt, state, length):
        """One answer, its log read into bench-ttft's --stats fields: load (the model mapped and
        its hyperparameters read), read (the session file into the cache, which llama.cpp clears
        first), prefill (the question), ttft (from the end of load to the first token's timings
        printed); the context's creation (its cache allocated and cleared), llama-cli's warm-up
        run and its tokenizing the whole prompt (to compare it with the session's tokens) fall in
        "rest". The prompt is not echoed (--no-display-prompt)."""
        text, wall, cpu = self.cli_run(prompt, state, length + 1)
        stamps = {}
        for line in text.splitlines():
            match = STAMP.match(line)
            if not match:
                continue
            minutes, seconds, millis, micros = (int(g) for g in match.groups()[:4])
            at = minutes * 60 + seconds + millis / 1e3 + micros / 1e6
            message = match.group(5)
            for key, marker in (("init", "llama_init_from_model:"),
                                ("warmup", "warming up the model"),
                                ("loading", "attempting to load saved session"),
                                ("loaded", "loaded a session"),
                                ("done", "llama_perf_context_print:")):
                if marker in message and key not in stamps:
                    stamps[key] = at
            found = re.search(r"session file matches (\d+) / (\d+) tokens", message)
            if found:
                stamps["matched"], stamps["prompt"] = int(found.group(1)), int(found.group(2))
            found = re.search(r"prompt eval time =\s+([\d.]+) ms", message)
            if found:
                stamps["prefill"] = float(found.group(1)) / 1e3
        missing = [k for k in ("init", "loading", "loaded", "done", "matched", "prefill")
                   if k not in stamps]
        if missing:
            tools.fail(f"llama-cli's log lacks {', '.join(missing)} (expected c392e50's log lines)")
        if stamps["matched"] != length + 1:
            tools.fail(f"llama-cli reused {stamps['matched']} of the session's {length + 1} tokens")
        return {
            "load_seconds": stamps["init"],
            "cache_open_seconds": 0.0,
            "cache_load_seconds": stamps["loaded"] - stamps["loading"],
            "realign_seconds": 0.0,
            "recompute_seconds": 0.0,
            "prompt_prefill_seconds": stamps["prefill"],
            "context_create_seconds": stamps.get("warmup", stamps["loading"]) - stamps["init"],
            "warmup_seconds": stamps["loading"] - stamps.get("warmup", stamps["loading"]),
            "time_to_first_token_seconds": stamps["done"] - stamps["init"],
            "total_seconds": stamps["done"],
            "prompt_tokens": stamps["prompt"] - stamps["matched"],
            "wall_seconds": wall, "cpu_seconds": cpu,
            "answer": "(llama.cpp from a tiled state: not comparable)",
        }

    def decode(self, prompt, state, length, tokens):
        """Seconds per token of `tokens` decoded after the question (llama.cpp's "eval time"
        over its runs: the tokens after the first, which the question's prefill gives)."""
        text, _, _ = self.cli_run(prompt, state, length + 1, tokens=tokens)
        found = re.search(r"\beval time =\s+([\d.]+) ms /\s+(\d+) runs", text)
        if not found or int(found.group(2)) == 0:
            tools.fail("llama-cli's log lacks its eval time (expected c392e50's timings)")
        return float(found.group(1)) / 1e3 / int(found.group(2))
