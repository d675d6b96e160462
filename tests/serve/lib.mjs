// Shared by the server tests: start `merlin serve` on a free loopback port (--port 0; the port is read from
// its startup line), wait for /health, stop it; tiny assertion and skip helpers.
import {spawn} from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import {fileURLToPath} from "node:url";

export const SKIP = 77;
export const here = path.dirname(fileURLToPath(import.meta.url));

export function skip(why) {
    console.log(`SKIP: ${why}`);
    process.exit(SKIP);
}

// argv: MERLIN_BIN MODEL.gguf
export function args() {
    const [bin, model] = process.argv.slice(2);
    if (!bin || !model) {
        console.error("usage: node TEST.mjs MERLIN_BIN MODEL.gguf");
        process.exit(2);
    }
    if (!fs.existsSync(model)) skip(`${model} not found`);
    return {bin, model};
}

export async function loadOpenAI() {
    try {
        return (await import("openai")).default;
    } catch {
        skip("the openai npm package is not installed (bash tests/serve/install.sh)");
    }
}

export async function sleep(ms) {
    return new Promise((r) => setTimeout(r, ms));
}

// Polls until fn() returns a truthy value or `ms` pass (then throws `what`).
export async function waitFor(fn, ms, what) {
    const end = Date.now() + ms;
    for (;;) {
        const v = await fn().catch(() => null);
        if (v) return v;
        if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
        await sleep(50);
    }
}

export async function startServer(bin, model, extra = []) {
    const proc = spawn(bin, ["serve", "-m", model, "--port", "0", ...extra], {stdio: ["ignore", "ignore", "pipe"]});
    let log = "";
    const port = await new Promise((resolve, reject) => {
        proc.stderr.on("data", (d) => {
            log += d.toString();
            const m = log.match(/listening on http:\/\/[^:]+:(\d+)/);
            if (m) resolve(Number(m[1]));
        });
        proc.on("exit", (code) => reject(new Error(`merlin serve exited (${code}) before listening:\n${log}`)));
        setTimeout(() => reject(new Error(`merlin serve did not start within 30 s:\n${log}`)), 30000);
    });
    const url = `http://127.0.0.1:${port}`;
    await waitFor(async () => (await fetch(`${url}/health`)).ok, 30000, "/health");
    return {
        url,
        proc,
        log: () => log,
        async stop() {
            if (proc.exitCode !== null) return proc.exitCode;
            const exited = new Promise((r) => proc.on("exit", (code, sig) => r(code ?? sig)));
            proc.kill("SIGTERM");
            return exited;
        },
    };
}

// Reads one Prometheus sample, e.g. metric(text, "merlin_kv_blocks_used").
export function metric(text, name) {
    const m = text.match(new RegExp(`^${name} (\\S+)$`, "m"));
    return m ? Number(m[1]) : NaN;
}

let failures = 0;
export function check(cond, what, detail = "") {
    if (cond) {
        console.log(`ok   ${what}`);
    } else {
        failures++;
        console.log(`FAIL ${what}${detail ? `\n     ${detail}` : ""}`);
    }
}
export function equal(a, b, what) {
    const sa = JSON.stringify(a), sb = JSON.stringify(b);
    check(sa === sb, what, `got ${sa}\n     want ${sb}`);
}
export function failed() {
    return failures;
}
