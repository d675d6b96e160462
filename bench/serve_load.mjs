#!/usr/bin/env node
// Load generator for `merlin serve` (bench/serve_bench.sh runs it): C clients, each sending streaming
// /v1/completions requests one after another until R requests are done in all. Prints one JSON line:
// aggregate generated tokens/s over the wall time, time to first token p50/p99, per-request decode rate.
//   node bench/serve_load.mjs URL -c CLIENTS [-r REQUESTS] [-n MAX_TOKENS] [-t TEMPERATURE] [--no-stream]
// --no-stream sends non-streaming requests: a request's "time to first token" is then its whole time, and its
// decode rate is its tokens over that time.
// Every request has a different prompt and generates exactly MAX_TOKENS tokens (ignore_eos), greedy unless -t.
// It shares the machine with the server, so it uses node:http (keep-alive) rather than fetch(): fetch's
// web streams cost about twice the CPU per SSE event. Every event is still read and parsed, and a request
// whose usage does not report MAX_TOKENS generated tokens, or that sent no text, is an error.
import http from "node:http";

const argv = process.argv.slice(2);
const url = argv[0] ? new URL(argv[0]) : null;
let clients = 1, requests = 0, maxTokens = 128, temperature = 0, stream = true;
for (let i = 1; i < argv.length; i++) {
    if (argv[i] === "-c") clients = Number(argv[++i]);
    else if (argv[i] === "-r") requests = Number(argv[++i]);
    else if (argv[i] === "-n") maxTokens = Number(argv[++i]);
    else if (argv[i] === "-t") temperature = Number(argv[++i]);
    else if (argv[i] === "--no-stream") stream = false;
}
if (!url || !(clients > 0)) {
    console.error("usage: node bench/serve_load.mjs URL -c CLIENTS [-r REQUESTS] [-n MAX_TOKENS] [-t TEMPERATURE] [--no-stream]");
    process.exit(2);
}
if (!requests) requests = Math.max(8, 2 * clients);
const agent = new http.Agent({keepAlive: true, maxSockets: clients});

const NAMES = ["Lily", "Tom", "Max", "Sue", "Ben", "Mia", "Sam", "Zoe", "Tim", "Amy", "Leo", "Eva"];
const THINGS = ["a red ball", "a big tree", "a small boat", "a blue bird", "a funny hat", "a old map", "a shiny key", "a soft bear"];
function prompt(i) {
    return `${NAMES[i % NAMES.length]} found ${THINGS[Math.floor(i / NAMES.length) % THINGS.length]} near the river. Story ${i}:`;
}

// One request: resolves to {ttft, seconds, tokens, events}.
function one(i) {
    return stream ? oneStreaming(i) : oneWhole(i);
}

function post(body, onResponse, reject) {
    const req = http.request({
        host: url.hostname, port: url.port, path: "/v1/completions", method: "POST", agent,
        headers: {"Content-Type": "application/json", "Content-Length": Buffer.byteLength(body)},
    }, onResponse);
    req.on("error", reject);
    req.end(body);
}

// A non-streaming request: one JSON body with the text and usage.
function oneWhole(i) {
    return new Promise((resolve, reject) => {
        const t0 = performance.now();
        const body = JSON.stringify({prompt: prompt(i), max_tokens: maxTokens, temperature, ignore_eos: true});
        post(body, (res) => {
            res.setEncoding("utf8");
            let buf = "";
            res.on("data", (s) => { buf += s; });
            res.on("end", () => {
                const seconds = (performance.now() - t0) / 1000;
                if (res.statusCode !== 200) return reject(new Error(`HTTP ${res.statusCode}: ${buf}`));
                const r = JSON.parse(buf);
                const tokens = r.usage?.completion_tokens, text = r.choices?.[0]?.text ?? "";
                if (tokens !== maxTokens || text.length === 0)
                    return reject(new Error(`request ${i}: ${tokens} tokens in usage (want ${maxTokens}), ${text.length} characters`));
                resolve({ttft: seconds, seconds, tokens, events: 0});
            });
            res.on("error", reject);
        }, reject);
    });
}

function oneStreaming(i) {
    return new Promise((resolve, reject) => {
        const t0 = performance.now();
        const body = JSON.stringify({prompt: prompt(i), max_tokens: maxTokens, temperature, ignore_eos: true, stream: true,
            stream_options: {include_usage: true}});
        post(body, (res) => {
            res.setEncoding("utf8");
            let buf = "", ttft = null, tokens = null, events = 0, text = 0, done = false, failed = null;
            res.on("data", (s) => {
                buf += s;
                let start = 0, end;
                while ((end = buf.indexOf("\n\n", start)) >= 0) {
                    const event = buf.slice(start, end);
                    start = end + 2;
                    if (!event.startsWith("data: ")) continue;  // an SSE comment (keep-alive)
                    ++events;
                    if (event === "data: [DONE]") { done = true; continue; }
                    const chunk = JSON.parse(event.slice(6));
                    if (chunk.error) failed ??= chunk.error.message;
                    const t = chunk.choices?.[0]?.text;
                    if (t) {
                        text += t.length;
                        if (ttft === null) ttft = (performance.now() - t0) / 1000;
                    }
                    if (chunk.usage) tokens = chunk.usage.completion_tokens;
                }
                buf = buf.slice(start);
            });
            res.on("end", () => {
                const seconds = (performance.now() - t0) / 1000;
                if (res.statusCode !== 200) return reject(new Error(`HTTP ${res.statusCode}: ${buf}`));
                if (failed) return reject(new Error(`request ${i}: ${failed}`));
                if (!done || tokens !== maxTokens || text === 0)
                    return reject(new Error(`request ${i}: [DONE] ${done}, ${tokens} tokens in usage (want ${maxTokens}), ${text} characters`));
                resolve({ttft: ttft ?? seconds, seconds, tokens, events});
            });
            res.on("error", reject);
        }, reject);
    });
}

function percentile(xs, p) {
    const s = [...xs].sort((a, b) => a - b);
    return s[Math.min(s.length - 1, Math.max(0, Math.ceil((p / 100) * s.length) - 1))];
}

let next = 0;
const results = [];
const t0 = performance.now();
await Promise.all(Array.from({length: clients}, async () => {
    while (next < requests) results.push(await one(next++));
}));
const wall = (performance.now() - t0) / 1000;
agent.destroy();
const tokens = results.reduce((s, r) => s + r.tokens, 0);
const decode = results.map((r) => stream ? (r.tokens - 1) / Math.max(1e-9, r.seconds - r.ttft) : r.tokens / r.seconds);
console.log(JSON.stringify({
    clients, requests, max_tokens: maxTokens, stream, tokens, seconds: +wall.toFixed(3),
    tokens_per_second: +(tokens / wall).toFixed(1),
    ttft_p50_ms: +(percentile(results.map((r) => r.ttft), 50) * 1000).toFixed(1),
    ttft_p99_ms: +(percentile(results.map((r) => r.ttft), 99) * 1000).toFixed(1),
    per_request_tokens_per_second_p50: +percentile(decode, 50).toFixed(1),
    sse_events: results.reduce((s, r) => s + r.events, 0),
}));
