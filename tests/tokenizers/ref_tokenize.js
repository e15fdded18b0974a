// The reference side of the tokenizer conformance suite for tokenizer.json files: Hugging Face's
// own tokenizers library (the Rust crate, through its Node.js binding, npm package
// "tokenizers"), as transformers' AutoTokenizer drives it.
//
// Usage: node ref_tokenize.js MODULES_DIR TOKENIZER_DIR CORPUS.jsonl > OUT.jsonl
//
// For each line {"text": ...} of the corpus it writes {"ids", "ids_special", "decoded",
// "decoded_special", "decoded_joined"}: the ids with add_special_tokens off and on,
// decode(ids, skip_special_tokens=true) of each, and the decoding of the ids with specials
// followed by the next line's (the last line's next is the first). transformers' own changes to the file's pipeline are
// applied: Llama-style tokenizer classes rebuild the post-processor's template from
// add_bos_token (default true) and add_eos_token (default false) in tokenizer_config.json
// (LlamaTokenizerFast.update_post_processor); truncation and padding are off. Decoding is the
// library's decode, without transformers' optional clean_up_tokenization_spaces rewriting.
"use strict";

const fs = require("fs");
const path = require("path");

function llamaStyle(tokenizerClass) {
    const name = (tokenizerClass || "").replace(/Fast$/, "");
    return ["LlamaTokenizer", "CodeLlamaTokenizer", "GemmaTokenizer"].includes(name);
}

function tokenContent(entry) {
    if (typeof entry === "string") return entry;
    if (entry && typeof entry.content === "string") return entry.content;
    return null;
}

function loadTokenizer(Tokenizer, directory) {
    const text = fs.readFileSync(path.join(directory, "tokenizer.json"), "utf8");
    const configPath = path.join(directory, "tokenizer_config.json");
    const config = fs.existsSync(configPath) ? JSON.parse(fs.readFileSync(configPath, "utf8")) : {};
    let tokenizer = Tokenizer.fromString(text);
    if (llamaStyle(config.tokenizer_class)) {
        const addBos = typeof config.add_bos_token === "boolean" ? config.add_bos_token : true;
        const addEos = typeof config.add_eos_token === "boolean" ? config.add_eos_token : false;
        const single = [];
        const specials = {};
        const special = (name) => {
            const id = tokenizer.tokenToId(name);
            if (id === null || id === undefined) throw new Error(`no id for ${name}`);
            specials[name] = {id: name, ids: [id], tokens: [name]};
            return {SpecialToken: {id: name, type_id: 0}};
        };
        const bos = tokenContent(config.bos_token);
        const eos = tokenContent(config.eos_token);
        if (addBos && bos) single.push(special(bos));
        single.push({Sequence: {id: "A", type_id: 0}});
        if (addEos && eos) single.push(special(eos));
        const json = JSON.parse(text);
        json.post_processor = {
            type: "TemplateProcessing",
            single,
            pair: [...single, {Sequence: {id: "B", type_id: 1}}],
            special_tokens: specials,
        };
        tokenizer = Tokenizer.fromString(JSON.stringify(json));
    }
    tokenizer.disableTruncation();
    tokenizer.disablePadding();
    return tokenizer;
}

async function main() {
    const [modules, directory, corpusPath] = process.argv.slice(2);
    if (!corpusPath) {
        process.stderr.write("usage: node ref_tokenize.js MODULES_DIR TOKENIZER_DIR CORPUS\n");
        process.exit(2);
    }
    const {Tokenizer} = require(path.join(path.resolve(modules), "node_modules", "tokenizers"));
    const tokenizer = loadTokenizer(Tokenizer, directory);
    const lines = fs.readFileSync(corpusPath, "utf8").split("\n").filter((line) => line !== "");
    const plain = [];
    const special = [];
    for (const line of lines) {
        const {text} = JSON.parse(line);
        plain.push((await tokenizer.encode(text, null, {addSpecialTokens: false})).getIds());
        special.push((await tokenizer.encode(text, null, {addSpecialTokens: true})).getIds());
    }
    const out = [];
    for (let i = 0; i < lines.length; ++i) {
        const joined = special[i].concat(special[(i + 1) % lines.length]);
        out.push(JSON.stringify({
            ids: plain[i],
            ids_special: special[i],
            decoded: await tokenizer.decode(plain[i], true),
            decoded_special: await tokenizer.decode(special[i], true),
            decoded_joined: await tokenizer.decode(joined, true),
        }));
    }
    process.stdout.write(out.join("\n") + (out.length ? "\n" : ""));
}

main().catch((error) => {
    process.stderr.write(`ref_tokenize.js: ${error.stack || error}\n`);
    process.exit(2);
});
