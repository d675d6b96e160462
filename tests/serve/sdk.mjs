#!/usr/bin/env node
// `merlin serve` driven by the official OpenAI SDK (openai@^6): models, completions and chat completions,
// streaming and not, stop sequences, n > 1, seeds, log-probabilities, usage, penalties, token prompts,
// X-Request-Id, /tokenize and /detokenize.
//   node tests/serve/sdk.mjs MERLIN_BIN MODEL.gguf
// Exit: 0 pass, 1 fail, 77 skip (no model or no openai package).
import {args, check, equal, failed, loadOpenAI, metric, startServer} from "./lib.mjs";

const {bin, model} = args();
const OpenAI = await loadOpenAI();
const server = await startServer(bin, model, ["--parallel", "8", "-t", "2"]);
const client = new OpenAI({baseURL: `${server.url}/v1`, apiKey: "unused", maxRetries: 0});
const PROMPT = "Once upon a time";
const MESSAGES = [{role: "system", content: "You tell stories."}, {role: "user", content: "Tell me about a cat."}];

async function collect(stream) {
    const out = {chunks: [], text: {}, finish: {}, usage: null, roles: 0, logprobs: {}};
    for await (const chunk of stream) {
        out.chunks.push(chunk);
        if (chunk.usage) out.usage = chunk.usage;
        for (const c of chunk.choices) {
            const piece = c.text ?? c.delta?.content ?? "";
            out.text[c.index] = (out.text[c.index] ?? "") + piece;
            if (c.delta?.role === "assistant") out.roles++;
            if (c.finish_reason) out.finish[c.index] = c.finish_reason;
            const lp = c.logprobs?.content ?? c.logprobs?.tokens;
            if (lp) out.logprobs[c.index] = (out.logprobs[c.index] ?? []).concat(lp);
        }
    }
    return out;
}

async function testModels() {
    const list = await client.models.list();
    const ids = list.data.map((m) => m.id);
    equal(ids, ["merlin-default"], "models.list names the model");
    const one = await client.models.retrieve("merlin-default");
    equal(one.id, "merlin-default", "models.retrieve");
}

async function testCompletions() {
    const base = {model: "merlin-default", prompt: PROMPT, max_tokens: 24, temperature: 0};
    const r = await client.completions.create(base);
    check(r.object === "text_completion" && r.id.startsWith("cmpl-"), "completion object and id");
    check(r.choices[0].text.length > 0, "completion text", JSON.stringify(r.choices[0]));
    equal(r.choices[0].finish_reason, "length", "finish_reason length");
    equal([r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens], [4, 24, 28], "completion usage");

    const s = await collect(await client.completions.create({...base, stream: true, stream_options: {include_usage: true}}));
    equal(s.text[0], r.choices[0].text, "streamed completion equals the non-streamed one (greedy)");
    equal(s.finish[0], "length", "streamed finish_reason");
    equal(s.usage?.completion_tokens, 24, "streamed usage (include_usage)");
    check(s.chunks.at(-1).choices.length === 0, "usage chunk has no choices");

    const t = await client.completions.create({...base, prompt: [464, 3797, 3332], max_tokens: 8});
    equal(t.usage.prompt_tokens, 3, "token-array prompt");
    const multi = await client.completions.create({...base, prompt: [PROMPT, "The dog"], max_tokens: 8});
    equal(multi.choices.map((c) => c.index), [0, 1], "array of prompts: one choice each");
    equal(multi.choices[0].text, r.choices[0].text.slice(0, multi.choices[0].text.length), "first prompt's choice is the greedy text");
}

async function testChat() {
    const base = {model: "merlin-default", messages: MESSAGES, max_completion_tokens: 20, temperature: 0};
    const r = await client.chat.completions.create(base);
    check(r.object === "chat.completion" && r.id.startsWith("chatcmpl-"), "chat object and id");
    equal(r.choices[0].message.role, "assistant", "chat message role");
    check(r.choices[0].message.content.length > 0, "chat content");
    check(["length", "stop"].includes(r.choices[0].finish_reason), "chat finish_reason");
    check(r.usage.prompt_tokens > 10 && r.usage.completion_tokens > 0, "chat usage", JSON.stringify(r.usage));

    const s = await collect(await client.chat.completions.create({...base, stream: true}));
    equal(s.text[0], r.choices[0].message.content, "streamed chat equals the non-streamed one (greedy)");
    equal(s.roles, 1, "one role chunk");
    equal(s.finish[0], r.choices[0].finish_reason, "streamed chat finish_reason");
    const last = s.chunks.at(-1).choices[0];
    check(last.finish_reason && Object.keys(last.delta).length === 0, "last chat chunk: empty delta + finish_reason");
    check(s.usage === null, "no usage chunk unless asked");
}

async function testStop() {
    const base = {model: "merlin-default", prompt: PROMPT, max_tokens: 40, temperature: 0};
    const full = (await client.completions.create(base)).choices[0].text;
    // A stop string that starts inside one token and ends inside another.
    const at = full.indexOf(" ", 20);
    const stop = full.slice(at - 2, at + 3);
    const want = full.slice(0, full.indexOf(stop));
    const r = await client.completions.create({...base, stop});
    equal(r.choices[0].text, want, `stop "${stop}" cuts the text before it`);
    equal(r.choices[0].finish_reason, "stop", "finish_reason stop");
    check(r.usage.completion_tokens < 40, "generation ended at the stop string", `completion_tokens ${r.usage.completion_tokens}`);
    const s = await collect(await client.completions.create({...base, stop: ["never-appears", stop], stream: true}));
    equal(s.text[0], want, "streamed text stops before the stop string");
    equal(s.finish[0], "stop", "streamed finish_reason stop");

    const chatFull = (await client.chat.completions.create({model: "m", messages: MESSAGES, max_tokens: 30, temperature: 0})).choices[0].message.content;
    const word = chatFull.split(" ").filter((w) => w.length > 2)[2];
    if (word) {
        const c = await client.chat.completions.create({model: "m", messages: MESSAGES, max_tokens: 30, temperature: 0, stop: [word]});
        equal(c.choices[0].message.content, chatFull.slice(0, chatFull.indexOf(word)), "chat stop sequence");
    }
}

async function testNAndSeeds() {
    const base = {model: "m", prompt: PROMPT, max_tokens: 16, temperature: 1.0, seed: 1234, n: 3};
    const a = await client.completions.create(base);
    equal(a.choices.map((c) => c.index), [0, 1, 2], "n=3: three choices, indexed");
    equal(a.usage.prompt_tokens, 4, "n=3: the prompt counts once");
    equal(a.usage.completion_tokens, a.choices.length * 16, "n=3: completion tokens of all choices");
    check(new Set(a.choices.map((c) => c.text)).size > 1, "n=3 with a seed: choices differ");
    const b = await client.completions.create(base);
    equal(b.choices.map((c) => c.text), a.choices.map((c) => c.text), "same seed, same texts");
    const other = await client.completions.create({...base, seed: 99, n: 1});
    check(other.choices[0].text !== a.choices[0].text, "another seed, another text");

    const s = await collect(await client.chat.completions.create({model: "m", messages: MESSAGES, max_tokens: 8, n: 2, seed: 5, stream: true}));
    equal(Object.keys(s.text).sort(), ["0", "1"], "streamed chat n=2: both choices");
    equal(s.roles, 2, "streamed chat n=2: a role chunk per choice");
    const again = await client.chat.completions.create({model: "m", messages: MESSAGES, max_tokens: 8, n: 2, seed: 5});
    equal(again.choices.map((c) => c.message.content), [s.text[0], s.text[1]], "streamed and whole chat agree for a seed");
}

async function testLogprobs() {
    const r = await client.completions.create({model: "m", prompt: PROMPT, max_tokens: 6, temperature: 0, logprobs: 3});
    const lp = r.choices[0].logprobs;
    equal(lp.tokens.length, 6, "completions logprobs: one entry per token");
    equal(lp.tokens.join(""), r.choices[0].text, "logprob tokens spell the text");
    check(lp.token_logprobs.every((x) => x <= 0), "log-probabilities are <= 0");
    check(lp.top_logprobs.every((t) => Object.keys(t).length >= 1 && Object.keys(t).length <= 3), "top_logprobs has <= 3 alternatives");
    check(lp.top_logprobs.every((t, i) => Math.abs(Math.max(...Object.values(t)) - lp.token_logprobs[i]) < 1e-4),
        "greedy: the chosen token is the most likely alternative");
    equal(lp.text_offset[0], 0, "text_offset starts at 0");

    // echo: the prompt comes back first; with logprobs every prompt token is scored (the first one null), and
    // max_tokens 0 scores a text without generating (what evaluation harnesses send).
    const e = await client.completions.create({model: "m", prompt: PROMPT, max_tokens: 3, temperature: 0, logprobs: 1, echo: true});
    const elp = e.choices[0].logprobs;
    check(e.choices[0].text.startsWith(PROMPT) && e.choices[0].text.slice(PROMPT.length) === r.choices[0].text.slice(0, e.choices[0].text.length - PROMPT.length),
        "echo: the prompt, then the same greedy text");
    equal(elp.tokens.length, e.usage.prompt_tokens + e.usage.completion_tokens, "echo logprobs: prompt and generated tokens");
    equal(elp.tokens.join(""), e.choices[0].text, "echo logprob tokens spell the text");
    equal(elp.token_logprobs[0], null, "the first prompt token has no log-probability");
    equal(elp.top_logprobs[0], null, "nor alternatives");
    check(elp.token_logprobs.slice(1).every((x) => typeof x === "number" && x <= 0), "the other tokens' are numbers <= 0");
    const es = await collect(await client.completions.create({model: "m", prompt: PROMPT, max_tokens: 3, temperature: 0,
        logprobs: 1, echo: true, stream: true}));
    equal(es.text[0], e.choices[0].text, "streamed echo: the same text");
    equal(es.logprobs[0], elp.tokens, "streamed echo: the same logprob tokens");
    const score = await client.completions.create({model: "m", prompt: PROMPT, max_tokens: 0, logprobs: 0, echo: true});
    equal(score.choices[0].text, PROMPT, "max_tokens 0 with echo: the prompt only");
    equal(score.usage.completion_tokens, 0, "max_tokens 0 with echo: nothing generated");
    equal(score.choices[0].logprobs.token_logprobs.slice(1), elp.token_logprobs.slice(1, score.usage.prompt_tokens),
        "scoring alone and with generation agree");

    const c = await client.chat.completions.create({model: "m", messages: MESSAGES, max_tokens: 5, temperature: 0, logprobs: true, top_logprobs: 2});
    const content = c.choices[0].logprobs.content;
    equal(content.length, c.usage.completion_tokens, "chat logprobs: one entry per token");
    check(content.every((e) => e.top_logprobs.length === 2 && Array.isArray(e.bytes)), "chat top_logprobs and bytes");
    equal(content.map((e) => e.token).join(""), c.choices[0].message.content, "chat logprob tokens spell the content");
    const s = await collect(await client.chat.completions.create({model: "m", messages: MESSAGES, max_tokens: 5, temperature: 0, logprobs: true, top_logprobs: 2, stream: true}));
    equal(s.logprobs[0].map((e) => e.token), content.map((e) => e.token), "streamed chat logprobs");
    const plain = await client.chat.completions.create({model: "m", messages: MESSAGES, max_tokens: 2});
    equal(plain.choices[0].logprobs, null, "logprobs null unless asked");
}

async function testPenaltiesAndSampling() {
    const r = await client.completions.create({model: "m", prompt: PROMPT, max_tokens: 30, temperature: 0, frequency_penalty: 2, presence_penalty: 2});
    const words = r.choices[0].text.trim().split(/\s+/);
    check(new Set(words).size >= words.length * 0.7, "penalties: few repeated words", r.choices[0].text);
    const k = await client.completions.create({model: "m", prompt: PROMPT, max_tokens: 8, temperature: 0.8, top_k: 1, seed: 1});
    const g = await client.completions.create({model: "m", prompt: PROMPT, max_tokens: 8, temperature: 0});
    equal(k.choices[0].text, g.choices[0].text, "top_k=1 is greedy");
    const m = await client.completions.create({model: "m", prompt: PROMPT, max_tokens: 8, temperature: 1.5, min_p: 0.99, top_p: 0.5, seed: 3});
    equal(m.choices[0].text, g.choices[0].text, "min_p=0.99 leaves only the top token");
    // logit_bias: +100 forces a token (11 is "," in GPT-2), -100 bans the greedy first token.
    const forced = await client.completions.create({model: "m", prompt: PROMPT, max_tokens: 5, temperature: 0, logit_bias: {"11": 100}});
    equal(forced.choices[0].text, ",,,,,", "logit_bias +100 forces the token");
    const g1 = await client.completions.create({model: "m", prompt: PROMPT, max_tokens: 1, temperature: 0});
    const ids = await (await fetch(`${server.url}/tokenize`, {method: "POST", body: JSON.stringify({content: g1.choices[0].text})})).json();
    const ban = Object.fromEntries(ids.tokens.map((t) => [String(t), -100]));
    const other = await client.completions.create({model: "m", prompt: PROMPT, max_tokens: 1, temperature: 0, logit_bias: ban});
    check(other.choices[0].text !== g1.choices[0].text, "logit_bias -100 bans the greedy token",
          `${JSON.stringify(g1.choices[0].text)} vs ${JSON.stringify(other.choices[0].text)}`);
}

async function testHeadersAndTokenize() {
    const {response} = await client.completions.create({model: "m", prompt: PROMPT, max_tokens: 2}, {headers: {"X-Request-Id": "my-id-42"}}).withResponse();
    equal(response.headers.get("x-request-id"), "my-id-42", "X-Request-Id echoed");
    const {response: r2} = await client.completions.create({model: "m", prompt: PROMPT, max_tokens: 1}).withResponse();
    check((r2.headers.get("x-request-id") ?? "").startsWith("req-"), "X-Request-Id generated when absent");

    const tok = await (await fetch(`${server.url}/tokenize`, {method: "POST", body: JSON.stringify({content: PROMPT})})).json();
    equal(tok.tokens, [7454, 2402, 257, 640], "/tokenize");
    const detok = await (await fetch(`${server.url}/detokenize`, {method: "POST", body: JSON.stringify({tokens: tok.tokens})})).json();
    equal(detok.content, PROMPT, "/detokenize round trip");
    const metrics = await (await fetch(`${server.url}/metrics`)).text();
    check(metric(metrics, "merlin_generated_tokens_total") > 0, "/metrics counts generated tokens");
    check(/merlin_http_requests_total\{endpoint="\/v1\/completions",status="200"\} \d+/.test(metrics), "/metrics counts requests by endpoint");
    check(metrics.includes("merlin_time_to_first_token_seconds_bucket"), "/metrics has the TTFT histogram");
}

let crashed = null;
try {
    for (const t of [testModels, testCompletions, testChat, testStop, testNAndSeeds, testLogprobs, testPenaltiesAndSampling, testHeadersAndTokenize]) {
        console.log(`--- ${t.name}`);
        await t();
    }
} catch (e) {
    crashed = e;
}
const code = await server.stop();
if (crashed) {
    console.log(`FAIL exception: ${crashed.stack}\n--- server log:\n${server.log()}`);
    process.exit(1);
}
check(code === 0, "server exits 0 on SIGTERM", `exit ${code}`);
if (failed()) console.log(`--- server log:\n${server.log()}`);
console.log(failed() ? `${failed()} check(s) failed` : "all checks passed");
process.exit(failed() ? 1 : 0);
