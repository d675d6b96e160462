#!/usr/bin/env node
// Load generator for `merlin serve` (bench/serve_bench.sh runs it): C clients, each sending streaming
// /v1/completions requests one after another until R requests are done in all. Prints one JSON line:
// aggregate generated tokens/s over the wall time, time to first token p50/p99, per-request decode rate.
//   node bench/serve_load.mjs URL -c CLIENTS [-r REQUESTS] [-n MAX_TOKENS]
// Every request has a different prompt and generates exactly MAX_TOKENS tokens (ignore_eos), greedy.
const argv = process.argv.slice(2);
const url = argv[0];
let clients = 1, requests = 0, maxTokens = 128;
for (let i = 1; i < argv.length; i++) {
    if (argv[i] === "-c") clients = Number(argv[++i]);
    else if (argv[i] === "-r") requests = Number(argv[++i]);
    else if (argv[i] === "-n") maxTokens = Number(argv[++i]);
}
if (!url || !(clients > 0)) {
    console.error("usage: node bench/serve_load.mjs URL -c CLIENTS [-r REQUESTS] [-n MAX_TOKENS]");
    process.exit(2);
}
if (!requests) requests = Math.max(8, 2 * clients);

const NAMES = ["Lily", "Tom", "Max", "Sue", "Ben", "Mia", "Sam", "Zoe", "Tim", "Amy", "Leo", "Eva"];
const THINGS = ["a red ball", "a big tree", "a small boat", "a blue bird", "a funny hat", "a old map", "a shiny key", "a soft bear"];
function prompt(i) {
    return `${NAMES[i % NAMES.length]} found ${THINGS[Math.floor(i / NAMES.length) % THINGS.length]} near the river. Story ${i}:`;
}

// One streaming request: returns {ttft, seconds, tokens}.
async function one(i) {
    const t0 = performance.now();
    const res = await fetch(`${url}/v1/completions`, {
        method: "POST",
        headers: {"Content-Type": "application/json"},
        body: JSON.stringify({prompt: prompt(i), max_tokens: maxTokens, temperature: 0, ignore_eos: true, stream: true,
            stream_options: {include_usage: true}}),
    });
    if (!res.ok) throw new Error(`HTTP ${res.status}: ${await res.text()}`);
    const decoder = new TextDecoder();
    let buf = "", ttft = null, tokens = 0;
    for await (const bytes of res.body) {
        buf += decoder.decode(bytes, {stream: true});
        let end;
        while ((end = buf.indexOf("\n\n")) >= 0) {
            const event = buf.slice(0, end);
            buf = buf.slice(end + 2);
            if (!event.startsWith("data: ") || event === "data: [DONE]") continue;
            const chunk = JSON.parse(event.slice(6));
            if (ttft === null && chunk.choices?.[0]?.text) ttft = (performance.now() - t0) / 1000;
            if (chunk.usage) tokens = chunk.usage.completion_tokens;
        }
    }
    return {ttft: ttft ?? (performance.now() - t0) / 1000, seconds: (performance.now() - t0) / 1000, tokens};
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
const tokens = results.reduce((s, r) => s + r.tokens, 0);
const decode = results.map((r) => (r.tokens - 1) / Math.max(1e-9, r.seconds - r.ttft));
console.log(JSON.stringify({
    clients, requests, max_tokens: maxTokens, tokens, seconds: +wall.toFixed(3),
    tokens_per_second: +(tokens / wall).toFixed(1),
    ttft_p50_ms: +(percentile(results.map((r) => r.ttft), 50) * 1000).toFixed(1),
    ttft_p99_ms: +(percentile(results.map((r) => r.ttft), 99) * 1000).toFixed(1),
    per_request_tokens_per_second_p50: +percentile(decode, 50).toFixed(1),
}));
