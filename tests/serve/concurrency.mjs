#!/usr/bin/env node
// 32 simultaneous streaming clients against one `merlin serve`, some of them disconnecting early:
//   * every finished response equals the same request run alone (greedy, and sampled with a seed):
//     continuous batching must not change a request's output (batch invariance);
//   * the clients that disconnect asked for 400 tokens: their sequences must be cancelled at once, so the
//     KV blocks are all back to free/cached right after the others finish (GET /metrics).
//   node tests/serve/concurrency.mjs MERLIN_BIN MODEL.gguf
// Exit: 0 pass, 1 fail, 77 skip.
import {args, check, equal, failed, loadOpenAI, metric, startServer, waitFor} from "./lib.mjs";

const {bin, model} = args();
const OpenAI = await loadOpenAI();
const CLIENTS = 32;
const MAX_TOKENS = 24;
const server = await startServer(bin, model, ["--parallel", String(CLIENTS), "-t", "2"]);
const client = new OpenAI({baseURL: `${server.url}/v1`, apiKey: "unused", maxRetries: 0, timeout: 120000});

// A shared opening so that the prefix cache has something to share, then a different ending per client.
const OPENING = "Once upon a time, in a small house at the edge of a big forest, there lived a little girl. ";
const ENDINGS = ["She had a red ball.", "One day it rained.", "Her dog was named Max.", "She liked to sing.",
    "The sun was hot.", "A bird came to visit.", "She found a box.", "Her mom made a cake."];

function request(i) {
    const early = i % 4 === 3;  // 8 of the 32 leave after a few chunks
    const sampled = i % 8 === 5;
    const body = {model: "m", max_tokens: early ? 400 : MAX_TOKENS, temperature: sampled ? 0.9 : 0, seed: sampled ? 1000 + i : undefined,
        ignore_eos: early};
    const text = (i % 3 === 0 ? "" : OPENING) + ENDINGS[i % ENDINGS.length] + (i >= 16 ? " Then" : "");
    if (i % 2 === 0) return {early, chat: true, body: {...body, messages: [{role: "user", content: text}]}};
    return {early, chat: false, body: {...body, prompt: text}};
}

async function alone(r) {
    if (r.chat) return (await client.chat.completions.create(r.body)).choices[0].message.content;
    return (await client.completions.create(r.body)).choices[0].text;
}

async function streamed(r) {
    const controller = new AbortController();
    const create = r.chat ? client.chat.completions : client.completions;
    const stream = await create.create({...r.body, stream: true}, {signal: controller.signal});
    let text = "", chunks = 0, finish = null;
    try {
        for await (const chunk of stream) {
            const c = chunk.choices[0];
            if (!c) continue;
            text += r.chat ? (c.delta?.content ?? "") : c.text;
            if (c.finish_reason) finish = c.finish_reason;
            if (r.early && ++chunks === 4) {
                controller.abort();
                break;
            }
        }
    } catch (e) {
        if (!r.early) throw e;
    }
    return {text, finish};
}

const requests = Array.from({length: CLIENTS}, (_, i) => request(i));
const t0 = Date.now();
const reference = [];
for (const r of requests) reference.push(r.early ? null : await alone(r));
console.log(`references: ${CLIENTS - 8} requests run one at a time in ${((Date.now() - t0) / 1000).toFixed(1)} s`);

const before = await (await fetch(`${server.url}/metrics`)).text();
const t1 = Date.now();
const results = await Promise.all(requests.map((r) => streamed(r)));
console.log(`concurrent: ${CLIENTS} streams in ${((Date.now() - t1) / 1000).toFixed(1)} s`);
for (let i = 0; i < CLIENTS; i++) {
    if (requests[i].early) continue;
    equal(results[i].text, reference[i], `client ${i} (${requests[i].chat ? "chat" : "completion"}, ${requests[i].body.temperature ? "sampled" : "greedy"}) matches its run alone`);
    check(results[i].finish === "length" || results[i].finish === "stop", `client ${i} finish_reason`, String(results[i].finish));
}

// The early leavers asked for 400 tokens each; they must be gone already.
const after = await waitFor(async () => {
    const m = await (await fetch(`${server.url}/metrics`)).text();
    return metric(m, "merlin_kv_blocks_used") === 0 && metric(m, "merlin_requests_running") === 0 ? m : null;
}, 5000, "all KV blocks back to free").catch((e) => {
    check(false, e.message);
    return null;
});
if (after) {
    check(true, "all KV blocks free or cached after the clients left");
    equal(metric(after, "merlin_kv_blocks_free"), metric(after, "merlin_kv_blocks_total"), "free (incl. cached) == total");
    check(metric(after, "merlin_kv_blocks_cached") > 0, "the prefix cache kept blocks");
    check(metric(after, "merlin_prompt_tokens_cached_total") > metric(before, "merlin_prompt_tokens_cached_total"), "shared prompt prefixes were served from the cache");
    const generated = metric(after, "merlin_generated_tokens_total") - metric(before, "merlin_generated_tokens_total");
    check(generated < (CLIENTS - 8) * MAX_TOKENS + 8 * 100, "disconnected clients' sequences were cancelled", `${generated} tokens generated`);
}
const cancelled = (server.log().match(/\| disconnected\n/g) ?? []).length;
equal(cancelled, 8, "8 streams logged as disconnected");

const code = await server.stop();
check(code === 0, "server exits 0 on SIGTERM", `exit ${code}`);
if (failed()) console.log(`--- server log (tail):\n${server.log().split("\n").slice(-60).join("\n")}`);
console.log(failed() ? `${failed()} check(s) failed` : "all checks passed");
process.exit(failed() ? 1 : 0);
