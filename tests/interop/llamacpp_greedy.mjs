#!/usr/bin/env node
// Interop: llama.cpp (through node-llama-cpp's prebuilt binding) loads the GGUF files Merlin writes and agrees
// with Merlin's greedy tokens.
//
//   node tests/interop/llamacpp_greedy.mjs MERLIN_BIN [--data-dir DIR] [--keep DIR] [-n N] [MODEL.gguf ...]
//
// Without MODEL arguments it writes its own random models with `merlin init` (GPT-2 vocabulary from
// DATA/tokenizer/gpt2; DATA is --data-dir, else $MERLIN_DATA, else $MERLIN_DEFAULT_DATA_DIR).
// For every model and prompt:
//   1. llama.cpp tokenizes the prompt; Merlin's own tokenization (-p) must give the same prompt length and the
//      same greedy continuation as Merlin fed llama.cpp's ids (--prompt-ids).
//   2. llama.cpp greedy-generates N tokens (LlamaContextSequence.evaluate, temperature 0: greedy sampler only,
//      no repetition penalty, no chat template, BOS only where the vocabulary asks for it (not GPT-2's),
//      end-of-text does not stop) and Merlin does the same
//      (`run --prompt-ids ... --temp 0 --ignore-eos --output-ids`): the ids must be identical.
//   3. The logits of prompt + generated tokens, llama.cpp (one batch, controlledEvaluate) vs `merlin logits
//      --mode prefill`: the largest difference over the whole vocabulary must stay within a per-type tolerance,
//      and the top-1/top-2 margins are reported. At a token divergence the logits of both candidate tokens in
//      both implementations are printed.
//   4. llama.cpp's detokenization of the generated ids equals Merlin's printed text.
// Exit: 0 pass, 1 fail, 77 skip (node_modules missing, llama.cpp binding not loadable, no vocabulary).

import {spawnSync} from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import {fileURLToPath} from "node:url";

const SKIP = 77;
const here = path.dirname(fileURLToPath(import.meta.url));

function skip(why) {
    console.log(`SKIP: ${why}`);
    process.exit(SKIP);
}

// ---------------------------------------------------------------- arguments
const argv = process.argv.slice(2);
let merlinBin = process.env.MERLIN_BIN;
let dataDir = process.env.MERLIN_DATA || process.env.MERLIN_DEFAULT_DATA_DIR;
let keepDir = null;
let nPredict = 32;
const modelArgs = [];
for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === "--data-dir") dataDir = argv[++i];
    else if (a === "--keep") keepDir = argv[++i];
    else if (a === "-n") nPredict = Number(argv[++i]);
    else if (a === "-h" || a === "--help") {
        console.log(fs.readFileSync(fileURLToPath(import.meta.url), "utf8").split("\n").slice(1, 20)
            .map((l) => l.replace(/^\/\/ ?/, "")).join("\n"));
        process.exit(0);
    } else if (merlinBin == null && modelArgs.length === 0 && !a.endsWith(".gguf")) merlinBin = a;
    else modelArgs.push(a);
}
if (!merlinBin) {
    console.error("usage: llamacpp_greedy.mjs MERLIN_BIN [--data-dir DIR] [--keep DIR] [-n N] [MODEL.gguf ...]");
    process.exit(1);
}
if (!fs.existsSync(merlinBin)) {
    console.error(`FAIL: merlin binary not found: ${merlinBin}`);
    process.exit(1);
}

// ---------------------------------------------------------------- llama.cpp binding
if (!fs.existsSync(path.join(here, "node_modules", "node-llama-cpp")))
    skip(`${path.join(here, "node_modules")} has no node-llama-cpp: run tests/interop/install.sh`);
let nlc;
try {
    nlc = await import("node-llama-cpp");
} catch (e) {
    skip(`cannot import node-llama-cpp: ${e.message}`);
}
let llama;
try {
    llama = await nlc.getLlama({
        gpu: false, build: "never", skipDownload: true, progressLogs: false,
        logLevel: nlc.LlamaLogLevel.error,
        // One thread: ggml's spinning thread barriers make a decode step take ~100x longer on a busy 2-core
        // machine (measured: 32 tokens of the sanity model 68 ms with 1 thread, 4-55 s with 2-4).
        maxThreads: 1,
    });
} catch (e) {
    skip(`the llama.cpp binding does not load (prebuilt @node-llama-cpp/linux-x64 missing or unusable?): ${e.message}`);
}

// ---------------------------------------------------------------- models
// Logit tolerance (max |llama.cpp - Merlin| over the vocabulary) by weight type. For f16/bf16 weights
// llama.cpp's CPU matmul also rounds the activations to f16/bf16 (ggml's vec_dot_type), Merlin keeps them
// in f32, so those differ more.
// The tolerance is relative to max(1, largest |logit|): a real model's logits are far larger than a random one's.
// Measured, relative (x86-64 AVX-512; llama.cpp picks its CPU variant at run time): f32 <= 5e-5, f16 <= 1e-3,
// bf16 <= 6e-3.
const TOL = {f32: 1e-4, f16: 5e-3, bf16: 2e-2};
const FILE_TYPES = {0: "f32", 1: "f16", 32: "bf16"};

const cases = [];
let tmpDir = null;
if (modelArgs.length > 0) {
    for (const m of modelArgs) cases.push({name: path.basename(m), path: m});
} else {
    const vocabDir = dataDir ? path.join(dataDir, "tokenizer", "gpt2") : null;
    if (!vocabDir || !fs.existsSync(path.join(vocabDir, "encoder.json")))
        skip(`no GPT-2 vocabulary (${vocabDir ?? "set MERLIN_DATA or --data-dir"}/encoder.json)`);
    tmpDir = keepDir ?? fs.mkdtempSync(path.join(os.tmpdir(), "merlin-interop-"));
    fs.mkdirSync(tmpDir, {recursive: true});
    const specs = [
        ["sanity-f32", ["--preset", "sanity", "--seed", "1", "--type", "f32"]],
        ["sanity-f16", ["--preset", "sanity", "--seed", "2", "--type", "f16"]],
        ["sanity-bf16", ["--preset", "sanity", "--seed", "3", "--type", "bf16"]],
        ["experiment-f32-gqa2-untied", ["--preset", "experiment", "--seed", "4", "--type", "f32", "--kv-heads", "2", "--untied"]],
        // Seed 6, not 5: with seed 5 the sentence's first generated token was a near-tie (top-2 margin 0.0067,
        // llama.cpp-Merlin logit difference 0.0058 from llama.cpp's bf16 rounding of activations): ids agreed
        // but could flip on another CPU. Seed 6's closest call is 119x its difference.
        ["experiment-bf16", ["--preset", "experiment", "--seed", "6", "--type", "bf16"]],
    ];
    for (const [name, opts] of specs) {
        const out = path.join(tmpDir, `${name}.gguf`);
        const r = spawnSync(merlinBin, ["init", ...opts, "--vocab-dir", vocabDir, "-o", out], {encoding: "utf8"});
        if (r.status !== 0) {
            console.error(`FAIL: merlin init ${opts.join(" ")}: exit ${r.status}\n${r.stderr}`);
            process.exit(1);
        }
        cases.push({name, path: out});
    }
    // The other direction, llama.cpp's own f32 files (SentencePiece vocabulary: also checks Merlin's SPM tokenizer
    // and BOS handling against llama.cpp's). Their f16/bf16 siblings are left out: with their peaked logits
    // llama.cpp's f16/bf16 rounding of activations flips near-ties (see README.md).
    for (const rel of ["models/tiny-llama-conformance/tiny-f32.gguf", "models/stories260K/stories260K.gguf"]) {
        const p = path.join(dataDir, rel);
        if (fs.existsSync(p)) cases.push({name: `llama.cpp:${path.basename(p, ".gguf")}`, path: p});
        else console.log(`note: ${p} not found, not checked`);
    }
}

// Prompts: the empty prompt starts from BOS in both (<|endoftext|> for GPT-2 vocabularies).
const PROMPTS = [
    "Once upon a time, there was a little robot named Merlin who loved to read.",
    "",
];
// Extra prompts only for the tokenization check (first model of each vocabulary type): whitespace runs, digits, contractions,
// non-ASCII, code.
const TOKENIZER_PROMPTS = [
    "  Hello   world!\n\n\tTabs and  double  spaces  ",
    "It's 2024: we've got 3.14159 and 1,000,000 reasons; don't we'll?",
    "Ünïcödé: naïve café — 東京 🙂 Привет",
    "def f(x):\n    return x**2  # comment",
];

// ---------------------------------------------------------------- helpers
function merlin(args) {
    const r = spawnSync(merlinBin, args, {maxBuffer: 256 << 20});
    return {status: r.status, stdout: r.stdout ?? Buffer.alloc(0), stderr: r.stderr?.toString() ?? String(r.error ?? "")};
}
function merlinGreedy(modelPath, promptArgs, n, extra = ["--output-ids"]) {
    const r = merlin(["run", "-m", modelPath, ...promptArgs, "-n", String(n), "--temp", "0", "--ignore-eos", "--kv-type", "f32", "-t", "1", ...extra]);
    if (r.status !== 0) throw new Error(`merlin run ${promptArgs.join(" ")} failed (exit ${r.status}): ${r.stderr.trim()}`);
    return r;
}
function parseIds(buf) {
    const s = buf.toString().trim();
    return s === "" ? [] : s.split(/\s+/).map(Number);
}
function promptTokensFromStderr(stderr) {
    const m = /prompt: (\d+) tokens/.exec(stderr);
    return m ? Number(m[1]) : null;
}
function merlinLogits(modelPath, tokens, outFile) {
    const r = merlin(["logits", "-m", modelPath, "--tokens", tokens.join(","), "--mode", "prefill", "-t", "1", "-o", outFile]);
    if (r.status !== 0) throw new Error(`merlin logits failed (exit ${r.status}): ${r.stderr.trim()}`);
    const b = fs.readFileSync(outFile);
    const f = new Float32Array(b.buffer.slice(b.byteOffset, b.byteOffset + b.length));
    const vocab = f.length / tokens.length;
    if (!Number.isInteger(vocab)) throw new Error(`merlin logits: ${f.length} floats for ${tokens.length} tokens`);
    return {vocab, row: (i) => f.subarray(i * vocab, (i + 1) * vocab)};
}
function top2(arr) {
    let a = -1, b = -1;
    for (let i = 0; i < arr.length; i++) {
        if (a < 0 || arr[i] > arr[a]) { b = a; a = i; } else if (b < 0 || arr[i] > arr[b]) b = i;
    }
    return [a, b];
}
const fmt = (x) => (Math.abs(x) < 1e-3 && x !== 0 ? x.toExponential(2) : x.toFixed(5));
// Invalid UTF-8 (a generated token may be half a character) decodes to U+FFFD in both; runs of it may differ in
// length between decoders, so they are collapsed before comparing.
const normText = (s) => s.replace(/\uFFFD+/g, "\uFFFD");

// ---------------------------------------------------------------- run
let failures = 0; // failed checks
let caseFailed = false; // the current model/prompt case has a failed check
const summary = []; // one line per case: {ok, text}
function fail(msg) {
    failures++;
    caseFailed = true;
    console.log(`  FAIL: ${msg}`);
}

const vocabTypesSeen = new Set();
const workDir = tmpDir ?? fs.mkdtempSync(path.join(os.tmpdir(), "merlin-interop-"));
for (const [ci, c] of cases.entries()) {
    console.log(`== ${c.name} (${c.path})`);
    let model, context;
    try {
        model = await llama.loadModel({modelPath: c.path});
    } catch (e) {
        fail(`llama.cpp cannot load ${c.path}: ${e.message}`);
        summary.push({ok: false, text: `${c.name}: llama.cpp cannot load it`});
        continue;
    }
    const fileType = model.fileInfo.metadata?.general?.file_type;
    const ftype = FILE_TYPES[fileType] ?? `file_type ${fileType}`;
    const tol = TOL[ftype] ?? TOL.bf16;
    const eot = model.tokens.eos;
    try {
        context = await model.createContext({
            contextSize: 256, batchSize: 256, sequences: 1, threads: 1, flashAttention: false,
            // Merlin's KV cache is f32; llama.cpp's default f16 cache would add its own rounding.
            experimentalKvCacheKeyType: "F32", experimentalKvCacheValueType: "F32",
        });
    } catch (e) {
        fail(`llama.cpp cannot create a context for ${c.path}: ${e.message}`);
        summary.push({ok: false, text: `${c.name}: llama.cpp cannot create a context`});
        await model.dispose();
        continue;
    }
    const seq = context.getSequence();
    // The tokenizer prompts run on the first model of each vocabulary type.
    const vocabType = model.vocabularyType;
    const prompts = vocabTypesSeen.has(vocabType) ? PROMPTS : [...PROMPTS, ...TOKENIZER_PROMPTS];
    vocabTypesSeen.add(vocabType);
    const modelNotes = [];
    for (const [pi, text] of prompts.entries()) {
        const label = text === "" ? "<empty>" : JSON.stringify(text.length > 40 ? text.slice(0, 37) + "..." : text);
        caseFailed = false;
        try {
            const tokenizerOnly = pi >= PROMPTS.length;
            const n = tokenizerOnly ? 8 : nPredict;
            // BOS as llama.cpp's own tools add it (SentencePiece vocabularies); GPT-2 vocabularies have none.
            const bos = model.tokens.bos;
            let promptIds = [...(model.tokens.shouldPrependBosToken && bos != null ? [bos] : []), ...model.tokenize(text, false)];
            if (promptIds.length === 0) promptIds = [bos ?? eot];

            // 1. tokenization: Merlin's own (-p) vs llama.cpp's ids (--prompt-ids).
            const viaIds = merlinGreedy(c.path, ["--prompt-ids", promptIds.join(",")], n);
            const viaText = merlinGreedy(c.path, ["-p", text], n);
            const idsA = parseIds(viaIds.stdout), idsB = parseIds(viaText.stdout);
            const nMerlinPrompt = promptTokensFromStderr(viaText.stderr);
            const tokOk = idsA.join() === idsB.join() && (nMerlinPrompt == null || nMerlinPrompt === promptIds.length);
            if (!tokOk)
                fail(`tokenization of ${label}: llama.cpp ${promptIds.length} ids [${promptIds}]; Merlin -p gives ` +
                    `${nMerlinPrompt} prompt tokens, continuation [${idsB}] vs [${idsA}] from llama.cpp's ids`);
            if (tokenizerOnly) {
                console.log(`  tokenize ${label}: ${promptIds.length} ids, ${tokOk ? "same as Merlin" : "DIFFERENT"}`);
                summary.push({ok: tokOk, text: `${c.name} tokenize ${label}: ${tokOk ? "same" : "DIFFERENT"}`});
                continue;
            }

            // 2. greedy generation in llama.cpp.
            await seq.clearHistory();
            const gen = [];
            for await (const t of seq.evaluate(promptIds, {temperature: 0, yieldEogToken: true})) {
                gen.push(t);
                if (gen.length >= n) break;
            }
            const merlinIds = idsA;
            let div = -1;
            for (let k = 0; k < Math.max(gen.length, merlinIds.length); k++)
                if (gen[k] !== merlinIds[k]) { div = k; break; }

            // 3. logits of prompt + generated (llama.cpp's) tokens in one batch, both implementations.
            const seqTokens = [...promptIds, ...gen.slice(0, n - 1)];
            const first = promptIds.length - 1;
            await seq.clearHistory();
            const want = {generateNext: {logits: true}};
            const out = await seq.controlledEvaluate(seqTokens.map((t, i) => (i >= first ? [t, want] : t)));
            const ml = merlinLogits(c.path, seqTokens, path.join(workDir, `logits-${ci}-${pi}.bin`));
            let closest = null;
            let maxDiff = 0, maxAbs = 0, minMarginL = Infinity, minMarginM = Infinity, batchArgmaxMismatch = 0;
            const vocab = ml.vocab;
            const lrows = [];
            for (let i = first; i < seqTokens.length; i++) {
                const lmap = out[i]?.next?.logits;
                if (!lmap || lmap.size !== vocab) throw new Error(`llama.cpp returned ${lmap?.size} logits at ${i}, Merlin ${vocab}`);
                const lrow = new Float32Array(vocab);
                for (const [tok, v] of lmap) lrow[tok] = v;
                lrows[i] = lrow;
                const mrow = ml.row(i);
                let rowDiff = 0;
                for (let v = 0; v < vocab; v++) {
                    rowDiff = Math.max(rowDiff, Math.abs(lrow[v] - mrow[v]));
                    maxAbs = Math.max(maxAbs, Math.abs(mrow[v]));
                }
                maxDiff = Math.max(maxDiff, rowDiff);
                const [la, lb] = top2(lrow), [ma, mb] = top2(mrow);
                minMarginL = Math.min(minMarginL, lrow[la] - lrow[lb]);
                minMarginM = Math.min(minMarginM, mrow[ma] - mrow[mb]);
                // The closest call: the generated position whose top-2 margin is smallest next to the logit
                // difference there (a margin below the difference could flip on another CPU or build).
                const margin = Math.min(lrow[la] - lrow[lb], mrow[ma] - mrow[mb]);
                if (closest == null || margin / rowDiff < closest.margin / closest.diff)
                    closest = {k: i - first, margin, diff: rowDiff};
                if (la !== gen[i - first]) batchArgmaxMismatch++;
            }
            const tolAbs = tol * Math.max(1, maxAbs);
            const logitsLine = `logits: max|llama.cpp-Merlin| ${fmt(maxDiff)} (tol ${fmt(tolAbs)}: ${ftype}, max|logit| ${fmt(maxAbs)}), ` +
                `min top1-top2 margin llama.cpp ${fmt(minMarginL)} / Merlin ${fmt(minMarginM)}; closest call: ` +
                `generated token ${closest.k}, margin ${fmt(closest.margin)} vs max|diff| there ${fmt(closest.diff)}`;
            if (batchArgmaxMismatch)
                modelNotes.push(`llama.cpp's batch argmax differs from its own incremental greedy at ${batchArgmaxMismatch} position(s)`);

            if (div < 0) {
                console.log(`  ${label}: ${promptIds.length} prompt ids -> ${gen.length} identical greedy ids [${gen.join(" ")}]`);
            } else {
                const i = first + div;
                const a = gen[div], b = merlinIds[div];
                const lrow = lrows[i], mrow = ml.row(i);
                fail(`${label}: greedy ids diverge at generated token ${div}: llama.cpp ${a}, Merlin ${b}\n` +
                    `    llama.cpp: [${gen.join(" ")}]\n    Merlin:    [${merlinIds.join(" ")}]\n` +
                    (a != null && b != null
                        ? `    at the divergence (same prefix): llama.cpp logit[${a}]=${fmt(lrow[a])} logit[${b}]=${fmt(lrow[b])}; ` +
                          `Merlin logit[${a}]=${fmt(mrow[a])} logit[${b}]=${fmt(mrow[b])}\n` +
                          `    logit[${a}]-logit[${b}]: llama.cpp ${fmt(lrow[a] - lrow[b])}, Merlin ${fmt(mrow[a] - mrow[b])}; ` +
                          `max|llama.cpp-Merlin| at this position ${fmt(Math.max(...lrow.map((x, v) => Math.abs(x - mrow[v]))))}`
                        : "    (one side produced fewer tokens)"));
            }
            console.log(`    ${logitsLine}`);
            if (closest.margin < 2 * closest.diff)
                console.log(`  WARNING: near-tie at generated token ${closest.k}: the ids agree here but could flip on ` +
                    `another CPU or llama.cpp build (margin ${fmt(closest.margin)}, logit difference ${fmt(closest.diff)})`);
            if (!(maxDiff <= tolAbs)) fail(`${label}: logits differ by ${fmt(maxDiff)} > ${fmt(tolAbs)}`);

            // 4. detokenization: llama.cpp's text of the generated ids vs Merlin's printed text.
            const mtext = merlinGreedy(c.path, ["--prompt-ids", promptIds.join(","), "--no-echo"], n, []).stdout.toString("utf8")
                .replace(/\n$/, ""); // Merlin ends its text with one newline
            const ltext = model.detokenize(gen, false, promptIds);
            if (div < 0 && normText(ltext) !== normText(mtext))
                fail(`${label}: detokenized text differs:\n    llama.cpp: ${JSON.stringify(ltext)}\n    Merlin:    ${JSON.stringify(mtext)}`);
            summary.push({ok: !caseFailed, text: `${c.name} ${label}: ${div < 0 ? "identical ids" : `ids DIVERGE at ${div}`}, ` +
                `max|dlogit| ${fmt(maxDiff)}, min top-2 margin ${fmt(Math.min(minMarginL, minMarginM))}, ` +
                `closest margin/diff ${(closest.margin / closest.diff).toPrecision(3)}`});
        } catch (e) {
            fail(`${label}: ${e.stack ?? e}`);
            summary.push({ok: false, text: `${c.name} ${label}: error`});
        }
    }
    for (const note of modelNotes) console.log(`  note: ${note}`);
    await context.dispose();
    await model.dispose();
}
await llama.dispose();
if (tmpDir && !keepDir) fs.rmSync(tmpDir, {recursive: true, force: true});
else if (!tmpDir) fs.rmSync(workDir, {recursive: true, force: true});

console.log("\nsummary:");
for (const {ok, text} of summary) console.log(`  ${ok ? "ok  " : "FAIL"} ${text}`);
const nFailed = summary.filter((x) => !x.ok).length;
console.log(`${summary.length - nFailed} passed, ${nFailed} failed`);
if (failures) {
    console.log(`FAIL: ${failures} check(s) failed`);
    process.exit(1);
}
console.log("PASS");
process.exit(0);
